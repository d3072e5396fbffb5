"""Time ``answer_spans``' votes (:func:`icecache.cache.spans.head_weights`) over a float16 host
store against the one-copy form they replaced (the whole store converted to float32, then one
product), in the same run, warm, one thread by default.

    python scripts/vote_speed.py [--rows 100000] [--rounds 20] [--threads 1]

The model's shapes: 3 KV heads, 3 query heads each, head_dim 64.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from icecache.cache.spans import head_weights


def one_copy(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> np.ndarray:
    s = torch.matmul(queries.float(), keys.float().transpose(1, 2)) * scale
    return torch.softmax(s, dim=-1).amax(dim=(0, 1)).double().numpy()


def timed(fn, rounds: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - t0) / rounds * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, a.rows, 64, generator=g).half()
    q = torch.randn(3, 3, 64, generator=g)
    same = np.abs(head_weights(q, keys, 0.125) - one_copy(q, keys, 0.125)).max()
    old = timed(lambda: one_copy(q, keys, 0.125), a.rounds)
    new = timed(lambda: head_weights(q, keys, 0.125), a.rounds)
    print(f"{a.rows} rows, {a.threads} thread(s): one copy {old:.1f} ms, blocks {new:.1f} ms "
          f"({old / new:.2f}x); largest weight difference {same:.2e}")


if __name__ == "__main__":
    main()
