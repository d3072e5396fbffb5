"""numba kernels of a lone query's walk down a DCI-tree (Algorithm 4): scan a node's children,
keep the beam's best, return the top-``k`` points.

References: :func:`topk_indices` is ``np.argsort(-scores, kind="stable")[:k]``;
:func:`search_many` with a beam over every node is ``icecache.index.reference.exact_topk``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ... import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from .pages import group_pages


@njit(nogil=True, cache=True, fastmath=True)
def _scan_node(node, v, vproj, PX, first_page, next_page, members, count, lo, hi, node_size,
               visit_frac, out_ids, out_scores, m):
    """Score ``node``'s children against ``v``, walking its pages outward from ``vproj``.

    Pages nearest to the query's projection come first (prioritized DCI at page granularity);
    the walk stops once ``visit_frac`` of the node's children were scored. Returns the new
    fill of ``out_ids``/``out_scores``.
    """
    pg = first_page[node]
    if pg < 0:
        return m
    # Collect the node's pages in order (nodes have few pages: ~ children / page_size).
    npg = 0
    q = pg
    while q >= 0:
        npg += 1
        q = next_page[q]
    pages = np.empty(npg, np.int32)
    q = pg
    j = 0
    start = 0
    while q >= 0:
        pages[j] = q
        if lo[q] <= vproj:
            start = j
        j += 1
        q = next_page[q]
    need = node_size[node] * visit_frac
    done = 0
    left = start - 1
    right = start
    D = PX.shape[2]
    while done < need and (left >= 0 or right < npg):
        if right >= npg:
            take = left
            left -= 1
        elif left < 0:
            take = right
            right += 1
        else:
            gap_l = vproj - hi[pages[left]]
            gap_r = lo[pages[right]] - vproj
            if gap_r < 0.0:
                gap_r = 0.0
            if gap_l <= gap_r:
                take = left
                left -= 1
            else:
                take = right
                right += 1
        pgt = pages[take]
        for s in range(count[pgt]):
            acc = np.float32(0.0)
            for d in range(D):
                acc += PX[pgt, s, d] * v[d]
            out_ids[m] = members[pgt, s]
            out_scores[m] = acc
            m += 1
        done += count[pgt]
    return m


TOPK_BINS = 2048  # topk_indices: buckets of the score range


@njit(nogil=True, cache=True)
def topk_indices(scores, k):
    """Indices of the ``k`` largest ``scores``, largest first (ties: lower index first): exactly
    ``np.argsort(-scores, kind="stable")[:k]``.

    The score range is cut into :data:`TOPK_BINS` equal buckets; the highest buckets that hold
    at least ``k`` scores are kept, in index order, and only those are sorted (stable, so ties
    keep index order). Three passes over the scores and a sort of about ``k`` of them: 3-4x
    faster at 10k scores than ``np.partition``, whose quickselect is slow on the
    walk's scores (similar keys' scores lie next to each other). A range that is not finite, or
    scores that all fall in the lowest bucket, sort everything."""
    n = scores.shape[0]
    if k <= 0:
        return np.empty(0, np.int64)
    lo = scores[0]
    hi = scores[0]
    for i in range(1, n):
        lo = min(lo, scores[i])
        hi = max(hi, scores[i])
    if k >= n or not (np.isfinite(lo) and np.isfinite(hi)):
        return np.argsort(-scores, kind="mergesort")[:k]
    nb = TOPK_BINS
    scale = np.float32(0.0)
    if hi > lo:
        scale = np.float32(nb - 1) / (hi - lo)  # 0 when the range overflows: one bucket
    bins = np.empty(n, np.int32)
    for i in range(n):  # monotone in the score, clamped (a NaN lands in bucket 0)
        bins[i] = max(0, min(np.int32((scores[i] - lo) * scale), nb - 1))
    counts = np.zeros(nb, np.int64)
    for i in range(n):
        counts[bins[i]] += 1
    kept = 0
    cut = nb - 1
    while cut > 0:
        kept += counts[cut]
        if kept >= k:
            break
        cut -= 1
    if cut == 0:
        kept = n
    sel = np.empty(kept, np.int64)
    m = 0
    for i in range(n):
        if bins[i] >= cut:
            sel[m] = i
            m += 1
    order = np.argsort(-scores[sel], kind="mergesort")
    return sel[order[:k]]


@njit(nogil=True, cache=True)
def query_tree(v, vproj, top_level, target_level, k, beam, visit_frac, PX, level, first_page,
               next_page, members, count, lo, hi, node_size, scratch_ids, scratch_scores):
    """Multi-level search: the ``k`` points of largest ``<x, v>``.

    From the root down, the ``beam`` best points of each level are expanded into their
    children. ``target_level`` >= 0 returns only points of that level (parent search, which
    stops there); -1 returns points of every level visited (page selection).
    ``scratch_*`` hold at least n entries. Returns (ids, scores), best first; fewer than ``k``
    when the tree holds fewer.
    """
    frontier = np.zeros(1, np.int32)  # node ids; the root
    stop = target_level if target_level >= 0 else 0
    kept = 0  # scratch[:kept] is the pool of returned candidates
    lvl = top_level
    while lvl >= stop:
        m = kept
        for f in range(frontier.shape[0]):
            m = _scan_node(frontier[f], v, vproj, PX, first_page, next_page, members, count, lo,
                           hi, node_size, visit_frac, scratch_ids, scratch_scores, m)
        seg = scratch_scores[kept:m]
        if lvl > stop and m > kept:
            best = topk_indices(seg, min(beam, m - kept))
            frontier = np.empty(best.shape[0], np.int32)
            for t in range(best.shape[0]):
                frontier[t] = scratch_ids[kept + best[t]] + 1
        if target_level < 0 or lvl == target_level:
            kept = m
        lvl -= 1
    kk = min(k, kept)
    order = topk_indices(scratch_scores[:kept], kk)
    return scratch_ids[:kept][order].copy(), scratch_scores[:kept][order].copy()


@njit(nogil=True, cache=True)
def search_many(queries, u, top_level, k, beam, visit_frac, PX, level, first_page, next_page,
                members, count, lo, hi, node_size, scratch_ids, scratch_scores, out_ids, out_scores):
    """``query_tree`` for each row of ``queries`` (h, d): top-``k`` ids and inner products.

    Each query is normalized and given a zero extra coordinate (the inner-product transform);
    scores are scaled back to ``<key, query>``. ``out_*`` (h, k) are filled, padded with -1/-inf.
    """
    h, d = queries.shape
    v = np.zeros(d + 1, np.float32)
    for r in range(h):
        nrm = 0.0
        for j in range(d):
            nrm += queries[r, j] * queries[r, j]
        nrm = max(np.sqrt(nrm), 1e-12)
        vp = np.float32(0.0)
        for j in range(d):
            v[j] = queries[r, j] / nrm
            vp += v[j] * u[j]
        ids, sc = query_tree(v, vp, top_level, -1, k, beam, visit_frac, PX, level, first_page,
                             next_page, members, count, lo, hi, node_size, scratch_ids,
                             scratch_scores)
        for t in range(k):
            if t < ids.shape[0]:
                out_ids[r, t] = ids[t]
                out_scores[r, t] = sc[t] * nrm
            else:
                out_ids[r, t] = -1
                out_scores[r, t] = -np.inf


@njit(nogil=True, cache=True)
def select_group(queries, k, max_pages, u, top_level, beam, visit_frac, PX, level, first_page,
                 next_page, members, count, lo, hi, node_size, tok_page, scratch_ids,
                 scratch_scores):
    """One KV head's page list for its group of query heads (g, d): search each, rank pages, merge."""
    g = queries.shape[0]
    ids = np.empty((g, k), np.int32)
    scores = np.empty((g, k), np.float32)
    search_many(queries, u, top_level, k, beam, visit_frac, PX, level, first_page, next_page,
                members, count, lo, hi, node_size, scratch_ids, scratch_scores, ids, scores)
    return group_pages(ids, tok_page, max_pages)
