"""Decode time per token with ``fast_step`` on and off (issue 18).

The same model, prompt and method in two sessions that take turns for ``ROUNDS`` rounds of 16
decode steps each, so a machine whose speed drifts slows both alike; prints both medians.

    python scripts/fast_step_speed.py CTX METHOD WEIGHTS [ROUNDS]      e.g. 1024 ice float 10
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> None:
    from icecache.config import resolve_settings
    from icecache.generation import Session
    from icecache.models import load_model

    ctx, method, weights = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    base = resolve_settings("cpu", weights=weights)
    loaded = load_model(None, base)
    text = " ".join(f"Entry {i}: the harbor office logged ship number {i * 37 % 1000} at dawn." for i in range(9000))
    ids = loaded.tokenizer(text)["input_ids"][:ctx]
    sessions, token, times = {}, {}, {True: [], False: []}
    for flag in (True, False):
        s = Session(loaded, base.replace(fast_step=flag), method)
        s.new_tokens = rounds * 16 + 10
        logits, _ = s.prefill(ids)
        token[flag] = int(logits.argmax())
        for _ in range(3):  # warm-up steps
            token[flag] = int(s.forward([token[flag]]).argmax())
        sessions[flag] = s
    for _ in range(rounds):
        for flag in (True, False):
            s = sessions[flag]
            s.activate()
            for _ in range(16):
                t = time.perf_counter()
                token[flag] = int(s.forward([token[flag]]).argmax())
                times[flag].append(time.perf_counter() - t)
    fast, plain = (statistics.median(times[f]) * 1e3 for f in (True, False))
    print(f"ctx {ctx} {method} {weights}: fast_step {fast:.1f} ms, transformers forward {plain:.1f} ms, "
          f"saved {plain - fast:.1f} ms ({plain / fast:.3f}x); {len(times[True])} steps each, {rounds} rounds")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
