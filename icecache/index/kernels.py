"""numba kernels of the DCI-tree: page insertion with splits, and the multi-level query.

All kernels are ``nogil``, so that several heads' trees can be searched from threads at once.
Each has a plain NumPy counterpart in ``icecache.index.reference`` that the tests compare against.

Layout (one tree, one KV head; ``n`` points, ``D = head_dim + 1`` after the inner-product
transform). Node ids: 0 is the root, ``i + 1`` is point ``i``.

- The transformed keys (D float32 each) live only in ``PX``, page-major, at the point's
  ``tok_page``/``tok_slot``; the kernels that place or parent new points take those points' rows
  (``rows``) from the caller. ``proj``: (cap,) float32 projection on the tree's random
  direction; ``level``: (cap,) int8, 0 = bottom; ``parent``: (cap,) int32 node id.
- ``first_page``: (cap + 1,) int32, a node's first child page (-1: none); ``node_size``:
  (cap + 1,) int32 children per node.
- pages: ``members`` (pcap, S) int32 point ids; ``count`` (pcap,); ``next_page`` (pcap,) the
  node's next page in projection order; ``owner`` (pcap,) node id; ``lo``/``hi`` (pcap,) float32
  projection range of the members; ``dirty`` (pcap,) bool.
- ``tok_page``/``tok_slot``: (cap,) int32, where each point sits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(nogil=True, cache=True)
def insert_child(i, xi, node, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                 first_page, node_size, tok_page, tok_slot, npages):
    """Put point ``i`` (transformed key ``xi``) among ``node``'s children; return the new page
    count.

    The page whose projection range covers ``proj[i]`` takes it (pages of a node are disjoint,
    ordered runs along the projection). A full page is first split in half along the
    projection. Changed pages are marked dirty.
    """
    S = members.shape[1]
    p = proj[i]
    pg = first_page[node]
    if pg < 0:
        pg = npages
        npages += 1
        first_page[node] = pg
        next_page[pg] = -1
        owner[pg] = node
        count[pg] = 0
        lo[pg] = p
        hi[pg] = p
    else:
        # The last page whose range starts at or below p (or the first page).
        nxt = next_page[pg]
        while nxt >= 0 and lo[nxt] <= p:
            pg = nxt
            nxt = next_page[pg]
    if count[pg] == S:
        # Split: members sorted by projection, upper half to a new page right after this one.
        c = count[pg]
        vals = np.empty(c, np.float32)
        for s in range(c):
            vals[s] = proj[members[pg, s]]
        order = np.argsort(vals, kind="mergesort")
        tmp = members[pg, :c].copy()
        rows = PX[pg, :c].copy()
        new = npages
        npages += 1
        half = c // 2
        for s in range(half):
            members[pg, s] = tmp[order[s]]
            PX[pg, s] = rows[order[s]]
        for s in range(c - half):
            members[new, s] = tmp[order[half + s]]
            PX[new, s] = rows[order[half + s]]
        count[pg] = half
        count[new] = c - half
        next_page[new] = next_page[pg]
        next_page[pg] = new
        owner[new] = node
        dirty[pg] = True
        dirty[new] = True
        for s in range(half):
            tok_page[members[pg, s]] = pg
            tok_slot[members[pg, s]] = s
        for s in range(c - half):
            tok_page[members[new, s]] = new
            tok_slot[members[new, s]] = s
        lo[pg] = proj[members[pg, 0]]
        hi[pg] = proj[members[pg, half - 1]]
        lo[new] = proj[members[new, 0]]
        hi[new] = proj[members[new, c - half - 1]]
        if p >= lo[new]:
            pg = new
    s = count[pg]
    members[pg, s] = i
    PX[pg, s] = xi
    count[pg] = s + 1
    tok_page[i] = pg
    tok_slot[i] = s
    if p < lo[pg]:
        lo[pg] = p
    if p > hi[pg]:
        hi[pg] = p
    dirty[pg] = True
    node_size[node] += 1
    return npages


@njit(nogil=True, cache=True)
def attach_sorted(ids, rows, parents, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                  first_page, node_size, tok_page, tok_slot, npages):
    """Bulk attach: ``ids`` sorted by (parent, projection), ``rows[t]`` the transformed key of
    ``ids[t]``; return the new page count.

    A parent that has no children yet gets them as full pages, in projection order; any other
    parent takes them one by one through ``insert_child``. Pages built here are marked dirty.
    """
    S = members.shape[1]
    n = ids.shape[0]
    a = 0
    while a < n:
        node = parents[a]
        b = a
        while b < n and parents[b] == node:
            b += 1
        if first_page[node] >= 0:
            for t in range(a, b):
                npages = insert_child(ids[t], rows[t], node, proj, PX, members, count, next_page, owner,
                                      lo, hi, dirty, first_page, node_size, tok_page, tok_slot,
                                      npages)
        else:
            prev = -1
            for c in range(a, b, S):
                pg = npages
                npages += 1
                e = min(c + S, b)
                for t in range(c, e):
                    members[pg, t - c] = ids[t]
                    PX[pg, t - c] = rows[t]
                    tok_page[ids[t]] = pg
                    tok_slot[ids[t]] = t - c
                count[pg] = e - c
                owner[pg] = node
                next_page[pg] = -1
                lo[pg] = proj[ids[c]]
                hi[pg] = proj[ids[e - 1]]
                dirty[pg] = True
                if prev < 0:
                    first_page[node] = pg
                else:
                    next_page[prev] = pg
                prev = pg
            node_size[node] += b - a
        a = b
    return npages


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


@njit(nogil=True, cache=True)
def topk_indices(scores, k):
    """Indices of the ``k`` largest ``scores``, largest first (ties: lower index first)."""
    n = scores.shape[0]
    if k >= n:
        return np.argsort(-scores, kind="mergesort")
    thr = -np.partition(-scores, k - 1)[k - 1]
    sel = np.empty(k, np.int64)
    m = 0
    for i in range(n):
        if scores[i] > thr:
            sel[m] = i
            m += 1
    for i in range(n):
        if m >= k:
            break
        if scores[i] == thr:
            sel[m] = i
            m += 1
    order = np.argsort(-scores[sel], kind="mergesort")
    return sel[order]


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
def parents_by_tree(rows, u, top_level, target_level, beam, visit_frac, PX, level, first_page,
                    next_page, members, count, lo, hi, node_size, scratch_ids, scratch_scores, out):
    """Parent search for many points in one call: ``query_tree`` down to ``target_level`` with
    each point's transformed key (``rows``), the nearest found there + 1 (a node id) in ``out``
    (0, the root, when that level is empty)."""
    D = rows.shape[1]
    for j in range(rows.shape[0]):
        v = rows[j]
        vp = np.float32(0.0)
        for c in range(D):
            vp += v[c] * u[c]
        got, _ = query_tree(v, vp, top_level, target_level, 1, beam, visit_frac, PX, level,
                            first_page, next_page, members, count, lo, hi, node_size,
                            scratch_ids, scratch_scores)
        out[j] = got[0] + 1 if got.shape[0] else 0


@njit(nogil=True, cache=True, fastmath=True)
def nearest_among(rows, C, cand, out):
    """For each row ``rows[j]``, the ``cand`` point (transformed keys ``C``) of largest inner
    product (exact), in ``out``.

    Used for the parents of a few new points (single inserts), where a BLAS call costs more in
    overhead and thread wake-up than the arithmetic.
    """
    D = rows.shape[1]
    for j in range(rows.shape[0]):
        best = -np.inf
        arg = -1
        for c in range(cand.shape[0]):
            acc = np.float32(0.0)
            for d in range(D):
                acc += rows[j, d] * C[c, d]
            if acc > best:
                best = acc
                arg = cand[c]
        out[j] = arg


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
def ranked_pages(ids, tok_page, max_pages):
    """Distinct pages of ``ids`` (best first), in order of their best member, at most ``max_pages``."""
    out = np.empty(min(max_pages, ids.shape[0]), np.int32)
    m = 0
    for t in range(ids.shape[0]):
        if m >= max_pages:
            break
        p = tok_page[ids[t]]
        seen = False
        for j in range(m):
            if out[j] == p:
                seen = True
                break
        if not seen:
            out[m] = p
            m += 1
    return out[:m]


@njit(nogil=True, cache=True)
def merge_ranked(lists, lens, max_pages):
    """GQA merge in numba: rows of ``lists`` (g, m) with ``lens`` valid entries, rank by rank."""
    g = lists.shape[0]
    out = np.empty(max_pages, np.int32)
    m = 0
    longest = 0
    for r in range(g):
        longest = max(longest, lens[r])
    for rank in range(longest):
        for r in range(g):
            if rank < lens[r] and m < max_pages:
                p = lists[r, rank]
                seen = False
                for j in range(m):
                    if out[j] == p:
                        seen = True
                        break
                if not seen:
                    out[m] = p
                    m += 1
    return out[:m]


@njit(nogil=True, cache=True)
def group_pages(ids, tok_page, max_pages):
    """Each query's ranked distinct pages of its top ids (rows padded with -1), GQA-merged."""
    g, k = ids.shape
    lists = np.empty((g, max_pages), np.int32)
    lens = np.zeros(g, np.int64)
    for r in range(g):
        n = 0
        while n < k and ids[r, n] >= 0:
            n += 1
        pages = ranked_pages(ids[r, :n], tok_page, max_pages)
        lists[r, : pages.shape[0]] = pages
        lens[r] = pages.shape[0]
    return merge_ranked(lists, lens, max_pages)


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


@njit(nogil=True, cache=True, fastmath=True)
def _scan_node_shared(node, V, PX, first_page, next_page, members, count, out_ids, out_pages,
                      out_scores, m):
    """All children of ``node`` scored against every row of ``V`` (g, d): one read per page.

    The last column of the transformed keys is not read: the queries' is zero.
    """
    g, D = V.shape
    pg = first_page[node]
    while pg >= 0:
        for s in range(count[pg]):
            for r in range(g):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += PX[pg, s, d] * V[r, d]
                out_scores[m, r] = acc
            out_ids[m] = members[pg, s]
            out_pages[m] = pg
            m += 1
        pg = next_page[pg]
    return m


@njit(nogil=True, cache=True)
def _walk_shared(queries, beam, PX, top_level, first_page, next_page, members, count, node_size,
                 mark, scratch_ids, scratch_pages, scratch_scores):
    """The group's shared walk down the tree; returns (rows scored, query norms), or -1 rows
    when the scratch arrays are too short (the caller grows them and walks again).

    At each level the union of every query's ``beam`` best nodes is expanded, and each child is
    read once and scored against all queries (a GQA group's queries share one KV head, and
    reading the index, not arithmetic, is what a query costs). Row i of ``scratch_ids`` /
    ``scratch_pages`` / ``scratch_scores`` holds a scored point, its page and its score per
    query (unit-norm queries); a page's rows are contiguous, and each page is scanned once.
    """
    g, d = queries.shape
    V = np.zeros((g, d), np.float32)
    norms = np.empty(g, np.float32)
    for r in range(g):
        acc = 0.0
        for j in range(d):
            acc += queries[r, j] * queries[r, j]
        norms[r] = max(np.sqrt(acc), 1e-12)
        for j in range(d):
            V[r, j] = queries[r, j] / norms[r]
    stamp = mark[0] + 1  # mark[0] counts calls; node 0 (the root) is never marked
    mark[0] = stamp
    frontier = np.zeros(1, np.int64)
    kept = 0
    lvl = top_level
    while lvl >= 0:
        m = kept
        rows = scratch_ids.shape[0]
        for f in range(frontier.shape[0]):
            if m + node_size[frontier[f]] > rows:
                return -1, norms
            m = _scan_node_shared(frontier[f], V, PX, first_page, next_page, members, count,
                                  scratch_ids, scratch_pages, scratch_scores, m)
        if lvl > 0 and m > kept:
            nxt = np.empty(g * min(beam, m - kept), np.int64)
            nn = 0
            for r in range(g):
                best = topk_indices(scratch_scores[kept:m, r].copy(), min(beam, m - kept))
                for t in range(best.shape[0]):
                    node = scratch_ids[kept + best[t]] + 1
                    if mark[node] != stamp:
                        mark[node] = stamp
                        nxt[nn] = node
                        nn += 1
            frontier = nxt[:nn]
        kept = m
        lvl -= 1
    return kept, norms


@njit(nogil=True, cache=True)
def search_group_shared(queries, k, beam, PX, top_level, first_page, next_page, members, count,
                        node_size, mark, scratch_ids, scratch_pages, scratch_scores, out_ids,
                        out_scores):
    """Top-``k`` points for each of a group's queries (g, d), the group walking the tree together.

    Each query keeps its own beam and its own top-``k``, chosen among everything the group
    scanned (on clustered test data this finds more of the true top keys than lone walks with
    the same beam). ``mark``: int64 per node (n + 1), reused across calls; ``scratch_scores``:
    (rows, g). Returns False when the scratch was too short (nothing written).
    """
    g = queries.shape[0]
    kept, norms = _walk_shared(queries, beam, PX, top_level, first_page, next_page, members,
                               count, node_size, mark, scratch_ids, scratch_pages, scratch_scores)
    if kept < 0:
        return False
    for r in range(g):
        col = scratch_scores[:kept, r].copy()
        kk = min(k, kept)
        order = topk_indices(col, kk)
        for t in range(k):
            if t < kk:
                out_ids[r, t] = scratch_ids[order[t]]
                out_scores[r, t] = col[order[t]] * norms[r]
            else:
                out_ids[r, t] = -1
                out_scores[r, t] = -np.inf
    return True


@njit(nogil=True, cache=True)
def best_pages(scratch_pages, scratch_scores, kept, r, max_pages):
    """Query ``r``'s pages ranked by their best scored member, at most ``max_pages``.

    The same list as ``ranked_pages`` of the query's top ``max_pages x page_size`` points (a
    page's rank there is its best member's rank, and that many points cannot hold more than
    ``max_pages`` distinct pages before the last one's best member), without ranking the points.
    A page's scanned rows are one contiguous run (see ``_walk_shared``).
    """
    pages = np.empty(kept, np.int32)
    best = np.empty(kept, np.float32)
    n = 0
    i = 0
    while i < kept:
        p = scratch_pages[i]
        b = scratch_scores[i, r]
        i += 1
        while i < kept and scratch_pages[i] == p:
            if scratch_scores[i, r] > b:
                b = scratch_scores[i, r]
            i += 1
        pages[n] = p
        best[n] = b
        n += 1
    order = topk_indices(best[:n], min(max_pages, n))
    return pages[order]


@njit(nogil=True, cache=True)
def select_group_shared(queries, k, max_pages, beam, PX, top_level, first_page, next_page,
                        members, count, node_size, tok_page, mark, scratch_ids, scratch_pages,
                        scratch_scores):
    """``select_group`` with the shared walk of ``search_group_shared``.

    When ``k`` >= ``max_pages`` x page size (the cache's case: budget pages x page size), each
    query's page list comes from its best member per page (:func:`best_pages`) instead of ranking
    its top-``k`` points: the same pages, without sorting ``k`` points per query. Returns
    (pages, False) when the scratch was too short.
    """
    g = queries.shape[0]
    if k < max_pages * PX.shape[1]:
        ids = np.empty((g, k), np.int32)
        scores = np.empty((g, k), np.float32)
        if not search_group_shared(queries, k, beam, PX, top_level, first_page, next_page,
                                   members, count, node_size, mark, scratch_ids, scratch_pages,
                                   scratch_scores, ids, scores):
            return np.empty(0, np.int32), False
        return group_pages(ids, tok_page, max_pages), True
    kept, _ = _walk_shared(queries, beam, PX, top_level, first_page, next_page, members, count,
                           node_size, mark, scratch_ids, scratch_pages, scratch_scores)
    if kept < 0:
        return np.empty(0, np.int32), False
    lists = np.empty((g, max_pages), np.int32)
    lens = np.zeros(g, np.int64)
    for r in range(g):
        pages = best_pages(scratch_pages, scratch_scores, kept, r, max_pages)
        lists[r, : pages.shape[0]] = pages
        lens[r] = pages.shape[0]
    return merge_ranked(lists, lens, max_pages), True


@njit(parallel=True, cache=True)
def select_heads_shared(queries, k, max_pages, beams, PXs, top_levels, first_pages, next_pages,
                        members_t, counts, node_sizes, tok_pages, marks, sids, spgs, sscs, out,
                        lens, ok):
    """:func:`select_group_shared` for every KV head of a layer at once, the heads in parallel
    (numba's threads). queries (H, G, d); ``beams``/``top_levels`` (H,); the tree arrays and each
    head's scratch come as tuples indexed by head. Writes head h's pages to
    ``out[h, :lens[h]]``; ``ok[h]`` is False when its scratch was too short (nothing written)."""
    H = queries.shape[0]
    for h in prange(H):
        pages, good = select_group_shared(
            queries[h], k, max_pages, beams[h], PXs[h], top_levels[h], first_pages[h], next_pages[h],
            members_t[h], counts[h], node_sizes[h], tok_pages[h], marks[h], sids[h], spgs[h],
            sscs[h])
        ok[h] = good
        lens[h] = pages.shape[0]
        for i in range(pages.shape[0]):
            out[h, i] = pages[i]
