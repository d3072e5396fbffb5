"""Time the GQA merges of a decode step's page choice on real keys, warm, in one run: the rank
merge (the shipped default), the mass merge (``index_merge: mass``, its exponentials vectorized
since session 40) and the mass merge as it was before (one scalar ``np.exp`` per scanned row and
query, kept here as the baseline), after the same shared walk, and whether the two mass merges
choose the same pages.

    python scripts/merge_speed.py [--keys 16k] [--pages similar] [--budget 256] [--reps 50]

Keys and queries come from the embedded model (``icecache.bench.capture``, layers 2, 15, 29;
16 queries each); each KV head gets a DCI-tree as the cpu profile builds it (beam 32). One thread.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from icecache.index import IndexConfig, walk  # noqa: E402
from icecache.index.kernels import shared  # noqa: E402
from icecache.index.kernels.query import topk_indices  # noqa: E402
from icecache.index.tree import DCITree  # noqa: E402


@njit(nogil=True, fastmath=True)
def mass_pages_scalar(pages, starts, scratch_scores, norms, scale, max_pages):
    """The mass merge before session 40: the same estimate, one ``np.exp`` per row and query."""
    n = pages.shape[0]
    kept = starts[n]
    g = scratch_scores.shape[1]
    c = np.empty(g, np.float32)
    top = np.full(g, -np.inf, np.float32)
    for r in range(g):
        c[r] = norms[r] * scale
    for i in range(kept):
        for r in range(g):
            top[r] = max(top[r], scratch_scores[i, r] * c[r])
    z = np.zeros(g, np.float32)
    per_page = np.zeros((n, g), np.float32)
    for j in range(n):
        for i in range(starts[j], starts[j + 1]):
            for r in range(g):
                x = scratch_scores[i, r] * c[r] - top[r]
                if x > -shared.NEGLIGIBLE:
                    e = np.exp(x)
                    per_page[j, r] += e
                    z[r] += e
    mass = np.zeros(n, np.float32)
    for j in range(n):
        acc = np.float32(0.0)
        for r in range(g):
            acc += per_page[j, r] / z[r]
        mass[j] = acc
    return pages[topk_indices(mass, min(max_pages, n))]


@njit(nogil=True)
def ranks_merge(pages, starts, scratch_scores, norms, scale, max_pages):
    """The rank merge as ``select_group_shared`` runs it (the mass merges' arguments)."""
    return shared.ranks_pages(pages, starts, scratch_scores, max_pages)


def repeated(fn):
    """``fn`` called ``reps`` times inside numba (no dispatch in the timing)."""
    @njit
    def run(pages, starts, scores, norms, scale, max_pages, reps):
        x = 0
        for _ in range(reps):
            x += fn(pages, starts, scores, norms, scale, max_pages)[0]
        return x
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="16k")
    ap.add_argument("--pages", default="similar", choices=["projection", "similar"])
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    from icecache.bench.capture import capture
    from icecache.config import resolve_settings
    from icecache.models import load_model
    from icecache_cli.bench import parse_size

    settings = resolve_settings("cpu")
    n_keys, layers, ps = parse_size(a.keys), [2, 15, 29], settings.page_size
    cap = capture(load_model(None, settings), n_keys, layers, num_queries=16)
    merges = {"ranks": repeated(ranks_merge), "mass": repeated(shared.mass_pages),
              "mass (scalar exp, before)": repeated(mass_pages_scalar)}
    spent = dict.fromkeys(merges, 0.0)
    calls = same = rows = 0
    max_pages = a.budget // ps
    for layer in layers:
        K, Q = cap.keys[layer], cap.queries[layer]
        H, n, d = K.shape
        g = Q.shape[0] // H
        sink, window = settings.sink_pages * ps, settings.window_pages * ps
        for h in range(H):
            tree = DCITree(d, IndexConfig(page_size=ps, beam=settings.index_beam, pages=a.pages), capacity=n)
            tree.insert(np.ascontiguousarray(K[h, sink : n - window]))
            mark, sid, spg, ssc = walk.group_scratch(tree.n, g, 4 * walk.walk_rows(tree.n, settings.index_beam, g))
            for step in range(Q.shape[1]):
                q = np.ascontiguousarray(Q[h * g : (h + 1) * g, step])
                kept, norms = shared._walk_shared(q, settings.index_beam, tree.PX, tree.top_level, tree.first_page,
                                                  tree.next_page, tree.members, tree.count, tree.node_size,
                                                  mark, sid, spg, ssc)
                runs, starts = shared.page_runs(spg, kept)
                args = (runs, starts, ssc, norms, d ** -0.5, max_pages)
                for name, fn in merges.items():
                    fn(*args, 1)  # warm (numba compiles on the first call)
                    t0 = time.perf_counter()
                    fn(*args, a.reps)
                    spent[name] += (time.perf_counter() - t0) / a.reps
                same += shared.mass_pages(*args).tolist() == mass_pages_scalar(*args).tolist()
                calls += 1
                rows += kept
    print(f"{a.keys} keys, {a.pages} pages, budget {a.budget}: {calls} group calls, "
          f"{rows / calls:.0f} scanned rows each; per call: "
          + ", ".join(f"{k} {v / calls * 1e6:.1f} us" for k, v in spent.items())
          + f"; the two mass merges chose the same pages in order in {same} of {calls}")


if __name__ == "__main__":
    main()
