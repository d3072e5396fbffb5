"""What forking a prefilled session costs: one passkey case prefilled once (the profile's
prefill; sparse past the trained context) at the first budget, then forked to the second, as
`icecache eval` does for the budgets of one case. Prints the fork's seconds and the process's
resident memory before and after it, then each session's answer.

    python scripts/fork_memory.py --length 16k --budgets 64,256

Resident memory is read from /proc (Linux). ``--deep`` forks with the trees' and host stores'
copy-on-write turned off (every array copied at once, the behaviour before session 25), for a
side-by-side in one process.
"""
from __future__ import annotations

import argparse
import time

from icecache.cache.host_store import HostStore
from icecache.config import resolve_settings
from icecache.evals import passkey
from icecache.generation import Session
from icecache.index.tree import DCITree
from icecache.models import load_model
from icecache_cli.bench import parse_size


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def deep_copies() -> None:
    """Drop the sharing: a copy made with the default deepcopy of every attribute."""
    for cls in (DCITree, HostStore):
        del cls.__deepcopy__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--length", default="16k")
    ap.add_argument("--case", type=int, default=0)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--deep", action="store_true", help="copy everything at the fork (no sharing)")
    args = ap.parse_args()
    if args.deep:
        deep_copies()
    first_budget, second_budget = (int(b) for b in args.budgets.split(","))
    settings = resolve_settings(args.profile)
    loaded = load_model(None, settings)
    tok = loaded.tokenizer
    case = passkey.cases(tok, parse_size(args.length), args.n, args.seed)[args.case]
    ids = tok(case.prompt)["input_ids"]
    first = Session(loaded, settings.replace(budget=first_budget), "ice")
    first.new_tokens = args.new_tokens
    start = time.perf_counter()
    logits, _ = first.prefill(ids)
    print(f"prefill of {len(ids)} tokens (depth {case.depth}): {time.perf_counter() - start:.0f} s, "
          f"resident {rss_gb():.2f} GB", flush=True)
    before = rss_gb()
    start = time.perf_counter()
    twin = first.fork(settings.replace(budget=second_budget))
    took = time.perf_counter() - start
    after = rss_gb()
    print(f"fork to budget {second_budget} ({'deep copies' if args.deep else 'copy-on-write'}): "
          f"{took:.2f} s, resident {before:.2f} -> {after:.2f} GB (+{after - before:.2f})", flush=True)
    out, _ = twin.decode(logits.clone(), args.new_tokens)
    print(f"budget {second_budget}: {tok.decode(out)!r}, resident after its decode {rss_gb():.2f} GB", flush=True)
    del twin
    out, _ = first.decode(logits, args.new_tokens)
    print(f"budget {first_budget}: {tok.decode(out)!r} (answer {case.answer})", flush=True)


if __name__ == "__main__":
    main()
