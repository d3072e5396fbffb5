"""A decode step's page loads on the CPU: one numba call (``load_pool``) against the general path
(per-head plans, then torch's gather and scatter), in one process (issue 18).

One session of the embedded model with ``ice`` decodes after a prompt of CTX tokens; rounds of
16 steps take turns between the two paths (``ResidentKV.general_load``), so a drift of the
machine's speed slows both alike. Both paths keep the same pool state, so they load the same
pages. Prints the median time per token and per layer's load of each.

    python scripts/load_speed.py [CTX] [ROUNDS]      e.g. 1024 10
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> None:
    from icecache.cache.resident import ResidentKV
    from icecache.config import resolve_settings
    from icecache.generation import Session
    from icecache.models import load_model

    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    base = resolve_settings("cpu")
    loaded = load_model(None, base)
    text = " ".join(f"Entry {i}: the harbor office logged ship number {i * 37 % 1000} at dawn." for i in range(20000))
    ids = loaded.tokenizer(text)["input_ids"][:ctx]
    if len(ids) < ctx:
        raise SystemExit(f"the generated text has only {len(ids)} tokens")
    session = Session(loaded, base, "ice")
    session.new_tokens = rounds * 32 + 10
    logits, _ = session.prefill(ids)
    token = int(logits.argmax())
    for _ in range(4):  # warm-up steps (both paths compiled)
        ResidentKV.general_load = not ResidentKV.general_load
        token = int(session.forward([token]).argmax())
    plain_load = ResidentKV.load
    loads: dict[bool, list[float]] = {True: [], False: []}
    steps: dict[bool, list[float]] = {True: [], False: []}

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        out = plain_load(self, *args, **kwargs)
        loads[ResidentKV.general_load].append(time.perf_counter() - t)
        return out

    ResidentKV.load = timed
    for _ in range(rounds):
        for general in (True, False):
            ResidentKV.general_load = general
            for _ in range(16):
                t = time.perf_counter()
                token = int(session.forward([token]).argmax())
                steps[general].append(time.perf_counter() - t)
    ResidentKV.load, ResidentKV.general_load = plain_load, False
    med = {g: (statistics.median(steps[g]) * 1e3, statistics.median(loads[g]) * 1e6) for g in (True, False)}
    print(f"ctx {ctx}: general path {med[True][0]:.1f} ms per token ({med[True][1]:.0f} us per load), "
          f"one call {med[False][0]:.1f} ms ({med[False][1]:.0f} us per load); "
          f"{med[True][0] / med[False][0]:.3f}x per token, {med[True][1] / med[False][1]:.2f}x per load; "
          f"{len(steps[True])} steps each, {rounds} rounds")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
