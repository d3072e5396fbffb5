"""Teacher-forced agreement of a weight format against the float model (issue 18's quality check).

The float model (``full``) generates greedily from each fidelity document (the summarize prompts
of ``icecache eval --tasks fidelity``); the model with ``--weights`` is fed the same tokens, once
with ``full`` and once with each ``--methods``, and the next-token choice and KL(float || fast)
are compared at every step.

    python scripts/weights_fidelity.py --weights int8 --length 4k --n 4 --methods full,ice
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from icecache.config import resolve_settings
    from icecache.evals import fidelity
    from icecache.evals.runner import fidelity_prompts
    from icecache.models import load_model
    from icecache_cli.bench import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int8")
    ap.add_argument("--length", default="4k")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--methods", default="full,ice")
    ap.add_argument("--profile", default="cpu")
    args = ap.parse_args()

    base = resolve_settings(args.profile)
    fast = resolve_settings(args.profile, weights=args.weights)
    ref_model = load_model(None, base.replace(weights="float"))
    prompts = fidelity_prompts(ref_model.tokenizer, parse_size(args.length), args.n, 0)
    t0 = time.perf_counter()
    refs = [fidelity.reference(ref_model, base.replace(weights="float"), p, args.new_tokens) for p in prompts]
    print(f"references: {sum(len(r.tokens) for r in refs)} tokens of float {base.dtype} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    del ref_model
    model = load_model(None, fast)
    for method in args.methods.split(","):
        agree = total = 0
        kl = 0.0
        t0 = time.perf_counter()
        for ref in refs:
            f = fidelity.measure(model, fast, method, ref)
            agree, total, kl = agree + f.agree, total + f.total, kl + f.kl_sum
        print(f"{args.weights} {method}: agreement with float full {agree / max(1, total):.4f} "
              f"({agree}/{total}), mean KL {kl / max(1, total):.4f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
