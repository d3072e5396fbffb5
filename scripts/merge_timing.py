"""Time the GQA merge rules (ranks, mass, peaks) of one group's query on one DCI-tree, warm, the
rules interleaved so that they share whatever else runs on the machine.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python scripts/merge_timing.py [--keys 16384] [--repeats 40]

Synthetic clustered keys (tests/test_index.py's generator), head_dim 64, a group of 3 queries,
the cpu profile's beam (32 nodes or n/64), budget 256 (16 pages). Prints each rule's min and
median microseconds per group query.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from icecache.index import DCITree, IndexConfig, kernels  # noqa: E402
from tests.test_index import clustered  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args()
    keys = clustered(a.keys, d=64, clusters=200, seed=1).astype(np.float32)
    qs = clustered(3, d=64, clusters=200, seed=2).astype(np.float32)
    t = DCITree(64, IndexConfig(beam=32, beam_frac=0.016))
    t.insert(keys)
    beam = t.beam_for()

    def run(code: int):
        return t._walk(3, lambda mark, sid, spg, ssc: kernels.select_group_shared(
            qs, 256, 16, beam, t.PX, t.top_level, t.first_page, t.next_page, t.members, t.count,
            t.node_size, t.tok_page, mark, sid, spg, ssc, np.empty(0, np.int32), 0, t.owner, code, 0.125), beam)

    times: dict[int, list[float]] = {c: [] for c in range(len(kernels.MERGES))}
    for c in times:
        run(c)  # numba compiles (or loads) before the timer
    for _ in range(a.repeats):
        for c in times:
            t0 = time.perf_counter()
            for _ in range(10):
                run(c)
            times[c].append((time.perf_counter() - t0) / 10)
    for c, ts in times.items():
        print(f"{kernels.MERGES[c]}: min {1e6 * min(ts):.0f} us, median {1e6 * np.median(ts):.0f} us")


if __name__ == "__main__":
    main()
