"""The shared full-attention prefill's speed with and without recording the prompt's queries
(SnapKV's window, H2O's grid), and where a prefill's time goes (issue 18, session 44).

One process prefills CTX generated tokens ``ROUNDS`` times each way, taking turns (the order
flips every round, after a warm-up prefill), and prints tokens/s per run and the medians. With
``--profile``, one more prefill (recording) runs under ``torch.profiler`` and its op table is
printed.

    python scripts/prefill_record_speed.py CTX [ROUNDS] [--profile]      e.g. 8192 3
"""

from __future__ import annotations

import statistics
import sys
import time


def main() -> None:
    from icecache.bench.decode_bench import context_ids
    from icecache.config import resolve_settings
    from icecache.generation import prefill_once
    from icecache.models import load_model

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    ctx = int(args[0])
    rounds = int(args[1]) if len(args) > 1 else 3
    settings = resolve_settings("cpu")
    loaded = load_model(None, settings)
    ids = context_ids(loaded.tokenizer, ctx)
    prefill_once(loaded, settings, ids[: min(ctx, 2048)])  # warm-up
    speed: dict[int, list[float]] = {32: [], 0: []}
    for r in range(rounds):
        for observe in ((32, 0) if r % 2 == 0 else (0, 32)):
            t = time.perf_counter()
            prefill_once(loaded, settings, ids, observation=observe)
            speed[observe].append(ctx / (time.perf_counter() - t))
    print(f"ctx {ctx}: recording {[round(x) for x in speed[32]]} tokens/s (median "
          f"{statistics.median(speed[32]):.0f}), not recording {[round(x) for x in speed[0]]} "
          f"(median {statistics.median(speed[0]):.0f})")
    if "--profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            prefill_once(loaded, settings, ids)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
