"""Time ``answer_spans``' votes (:func:`icecache.cache.spans.head_weights`, whose float16 host
store is scored by the numba kernel ``half_scores``) against the forms they replaced, in the same
run, warm: the float32 reference a block at a time (``vote_scores_reference``, the votes until
session 40) and one copy of the whole store to float32 before one product (until session 30).
Two threads by default (torch's and numba's).

    python scripts/vote_speed.py [--rows 100000] [--rounds 20] [--threads 2]

The model's shapes: 3 KV heads, 3 query heads each, head_dim 64.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch

from icecache.cache.spans import head_weights, vote_scores_reference


def one_copy(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> np.ndarray:
    s = torch.matmul(queries.float(), keys.float().transpose(1, 2)) * scale
    return torch.softmax(s, dim=-1).amax(dim=(0, 1)).double().numpy()


def blocks(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> np.ndarray:
    s = vote_scores_reference(queries.float() * scale, keys)
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
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    numba.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, a.rows, 64, generator=g).half()
    q = torch.randn(3, 3, 64, generator=g)
    ref = blocks(q, keys, 0.125)
    same = np.abs(head_weights(q, keys, a.rows, 0.125) - ref).max()
    times = {
        "one copy": timed(lambda: one_copy(q, keys, 0.125), a.rounds),
        "blocks": timed(lambda: blocks(q, keys, 0.125), a.rounds),
        "kernel": timed(lambda: head_weights(q, keys, a.rows, 0.125), a.rounds),
    }
    print(f"{a.rows} rows, {a.threads} thread(s): "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items())
          + f" (kernel {times['blocks'] / times['kernel']:.2f}x blocks); largest weight difference "
          f"to blocks {same:.2e}")


if __name__ == "__main__":
    main()
