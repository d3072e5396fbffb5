"""A prompt's prefill in float32 and in bfloat16 (``prompt_compute``), side by side (issue 18,
session 45).

One process prefills CTX generated tokens ``ROUNDS`` times each way with the cpu profile and the
``dense`` method, taking turns (the order flips every round, after one warm-up prefill each way,
which also makes the int4 layers' 16-bit weights). It prints tokens/s per run and the medians,
then how far the 16-bit prompt moved the last position's logits and the last layer's keys.
``--sparse``: ``ice`` with a sparse prefill instead (the last layer's keys not compared).

    python scripts/prompt_compute_speed.py CTX [ROUNDS] [--sparse]      e.g. 8192 3
"""

from __future__ import annotations

import statistics
import sys
import time


def main() -> None:
    import torch

    from icecache.bench.decode_bench import context_ids
    from icecache.config import resolve_settings
    from icecache.generation import Session
    from icecache.models import load_model

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sparse = "--sparse" in sys.argv
    ctx = int(args[0])
    rounds = int(args[1]) if len(args) > 1 else 3
    base = resolve_settings("cpu").replace(doc_cache="off", **({"prefill": "sparse"} if sparse else {}))
    method = "ice" if sparse else "dense"
    loaded = load_model(None, base)
    ids = context_ids(loaded.tokenizer, ctx)
    kinds = ["model", "bfloat16"]
    speed: dict[str, list[float]] = {k: [] for k in kinds}
    last: dict[str, tuple] = {}

    def run(kind: str) -> float:
        session = Session(loaded, base.replace(prompt_compute=kind), method)
        session.new_tokens = 8
        t = time.perf_counter()
        with torch.inference_mode():
            logits, _ = session.prefill(ids)
        seconds = time.perf_counter() - t
        keys = None if sparse else session.cache.layers[-1].keys.clone()
        last[kind] = (logits.float().clone(), keys)
        return len(ids) / seconds

    for kind in kinds:
        print(f"warm-up {kind}: {run(kind):.0f} tokens/s", flush=True)
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            speed[kind].append(run(kind))
            print(f"round {r + 1} {kind}: {speed[kind][-1]:.0f} tokens/s", flush=True)
    for kind in kinds:
        print(f"median {kind}: {statistics.median(speed[kind]):.0f} tokens/s")
    ratio = statistics.median(speed["bfloat16"]) / statistics.median(speed["model"])
    print(f"bfloat16 / float32: {ratio:.2f}x")
    (la, ka), (lb, kb) = last["model"], last["bfloat16"]
    print(f"logits: largest difference {float((la - lb).abs().max()):.3f} (largest logit {float(la.abs().max()):.1f}); "
          f"greedy token {'the same' if int(la.argmax()) == int(lb.argmax()) else 'different'}; "
          f"top 5 {la.topk(5).indices.tolist()} vs {lb.topk(5).indices.tolist()}")
    if ka is not None:
        print(f"last layer's keys: relative difference {float((ka - kb).norm() / ka.norm()):.4f}")


if __name__ == "__main__":
    main()
