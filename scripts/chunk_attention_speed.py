"""One prompt chunk's attention, with the mask (what SDPA was given before session 36) and without
(the CPU fast paths), timed in one process on random tensors of the embedded model's shapes.

    python scripts/chunk_attention_speed.py [--chunk 2048] [--prefix 6144] [--resident 3300]
                                            [--threads 1] [--rounds 3]

``dense``: a full prefill's chunk over ``prefix`` rows before it (``chunked.prefix_causal``
against ``prefix_causal_reference``). ``sparse``: a sparse-prefill chunk over ``resident`` rows
(sink, pool, window; 10% of the non-chunk rows invalid) then itself (``paged.paged_chunk_flash``
against ``paged_chunk_sdpa``). Prints the median of ``rounds`` calls of each, the two taking turns,
and the largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from icecache.cache.chunked import prefix_causal, prefix_causal_reference
from icecache.cache.paged import paged_chunk_flash, paged_chunk_sdpa

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def timed(calls, rounds):
    times = {name: [] for name in calls}
    outs = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=6144)
    ap.add_argument("--resident", type=int, default=3300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    G, C, d, scale = HEADS // KV_HEADS, a.chunk, HEAD_DIM, HEAD_DIM ** -0.5

    q = torch.randn(1, HEADS, C, d)
    k, v = torch.randn(1, KV_HEADS, a.prefix + C, d), torch.randn(1, KV_HEADS, a.prefix + C, d)
    ms, outs = timed({"masked": lambda: prefix_causal_reference(q, k, v, scale),
                      "maskless": lambda: prefix_causal(q, k, v, scale)}, a.rounds)
    diff = float((outs["masked"] - outs["maskless"]).abs().max())
    print(f"dense chunk ({C} queries over {a.prefix} + {C} rows): masked {ms['masked']:.1f} ms, "
          f"maskless {ms['maskless']:.1f} ms ({ms['masked'] / ms['maskless']:.2f}x), max diff {diff:.1e}")

    L = max(a.resident, C + 1)
    at = L - C
    qs = torch.randn(KV_HEADS, G, C, d)
    ks, vs = torch.randn(KV_HEADS, L, d), torch.randn(KV_HEADS, L, d)
    valid = torch.rand(KV_HEADS, L) > 0.1
    valid[:, at:] = True
    ms, outs = timed({"masked": lambda: paged_chunk_sdpa(qs, ks, vs, valid, at, scale),
                      "maskless": lambda: paged_chunk_flash(qs, ks, vs, valid, at, scale)}, a.rounds)
    diff = float((outs["masked"] - outs["maskless"]).abs().max())
    print(f"sparse chunk ({C} queries over {at} resident rows + {C}): masked {ms['masked']:.1f} ms, "
          f"maskless {ms['maskless']:.1f} ms ({ms['masked'] / ms['maskless']:.2f}x), max diff {diff:.1e}")


if __name__ == "__main__":
    main()
