"""Decode time per token with the joined int4 products of ``fast_step`` on and off (issue 18).

One session of the embedded model (int4 weights, the cpu profile) decodes ``ROUNDS`` rounds of 16
steps with the joined q/k/v and gate/up products and 16 with each module's own product, taking
turns (the order flips every round), so a machine whose speed drifts slows both alike; prints
both medians. The tokens are the same either way (the products are equal bit for bit).

    python scripts/int4_join_speed.py CTX [METHOD] [ROUNDS]      e.g. 1024 ice 10
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> None:
    from icecache.config import resolve_settings
    from icecache.fast_step import fast_step_for
    from icecache.generation import Session
    from icecache.models import load_model

    ctx = int(sys.argv[1])
    method = sys.argv[2] if len(sys.argv) > 2 else "ice"
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    base = resolve_settings("cpu")
    loaded = load_model(None, base)
    text = " ".join(f"Entry {i}: the harbor office logged ship number {i * 37 % 1000} at dawn." for i in range(9000))
    ids = loaded.tokenizer(text)["input_ids"][:ctx]
    s = Session(loaded, base, method)
    s.new_tokens = rounds * 32 + 20
    fast = fast_step_for(loaded.model)
    joined = fast.int4 if fast is not None else None
    if joined is None:
        sys.exit("no joined int4 products for this model and profile")
    times: dict[bool, list[float]] = {True: [], False: []}
    logits, _ = s.prefill(ids)
    token = int(logits.argmax())
    for _ in range(5):  # warm-up steps
        token = int(s.forward([token]).argmax())
    for r in range(rounds):
        for flag in ((True, False) if r % 2 == 0 else (False, True)):
            fast.int4 = joined if flag else None
            for _ in range(16):
                t = time.perf_counter()
                token = int(s.forward([token]).argmax())
                times[flag].append(time.perf_counter() - t)
    fast.int4 = joined
    on, off = (statistics.median(times[f]) * 1e3 for f in (True, False))
    print(f"ctx {ctx} {method}: joined {on:.2f} ms, modules {off:.2f} ms, saved {off - on:.2f} ms "
          f"({off / on:.3f}x); {len(times[True])} steps each, {rounds} rounds")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
