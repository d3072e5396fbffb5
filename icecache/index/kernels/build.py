"""numba kernels that build a DCI-tree: place points in their parent's pages (with splits), and
find parents (exactly among few candidates, or by a walk down the tree).

Checked by the tree's structural invariants after builds and random inserts
(tests/test_index.py::check_invariants); :func:`nearest_among` against
``icecache.index.reference.nearest_inner``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ... import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from .query import query_tree


@njit(nogil=True, cache=True, fastmath=True)
def balanced_groups(rows, k, iters):
    """Balanced k-means of ``rows`` (c, D) into ``k`` groups of at most ceil(c / k) rows: centres
    start at rows spread evenly through the given order (the caller's projection order), then
    ``iters`` rounds of assigning (row, centre) pairs nearest first, each row once, while the
    centre has room, and moving each centre to its group's mean. Returns each row's group."""
    c, D = rows.shape
    cap = (c + k - 1) // k
    centres = np.empty((k, D), np.float32)
    for j in range(k):
        centres[j] = rows[min(c - 1, (2 * j + 1) * c // (2 * k))]
    labels = np.full(c, -1, np.int64)
    dist = np.empty(c * k, np.float32)
    for _ in range(iters):
        for j in range(k):
            cc = np.float32(0.0)
            for d in range(D):
                cc += centres[j, d] * centres[j, d]
            for r in range(c):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += rows[r, d] * centres[j, d]
                dist[r * k + j] = cc - 2.0 * acc
        order = np.argsort(dist, kind="mergesort")
        labels[:] = -1
        room = np.full(k, cap, np.int64)
        left = c
        for t in range(c * k):
            r, j = order[t] // k, order[t] % k
            if labels[r] < 0 and room[j] > 0:
                labels[r] = j
                room[j] -= 1
                left -= 1
                if left == 0:
                    break
        sums = np.zeros((k, D), np.float32)
        sizes = np.zeros(k, np.int64)
        for r in range(c):
            sums[labels[r]] += rows[r]
            sizes[labels[r]] += 1
        for j in range(k):
            if sizes[j]:
                centres[j] = sums[j] / sizes[j]
    return labels


@njit(nogil=True, cache=True, fastmath=True)
def _page_best(xi, pg, PX, count):
    """The largest inner product of ``xi`` with a member of page ``pg``."""
    D = PX.shape[2]
    best = -np.inf
    for s in range(count[pg]):
        acc = np.float32(0.0)
        for d in range(D):
            acc += PX[pg, s, d] * xi[d]
        best = max(best, acc)
    return best


@njit(nogil=True, cache=True)
def _nearest_page(xi, node, PX, first_page, next_page, count):
    """The page of ``node`` holding the child of largest inner product with ``xi``."""
    best = -np.inf
    arg = first_page[node]
    pg = arg
    while pg >= 0:
        b = _page_best(xi, pg, PX, count)
        if b > best:
            best = b
            arg = pg
        pg = next_page[pg]
    return arg


@njit(nogil=True, cache=True)
def _fill_page(pg, node, ids, rows, picks, proj, PX, members, count, owner, lo, hi, dirty, tok_page,
               tok_slot):
    """Page ``pg`` of ``node`` := points ``ids[picks]`` (transformed keys ``rows[picks]``) in that
    order, its projection range set, marked dirty."""
    for s in range(picks.shape[0]):
        t = picks[s]
        members[pg, s] = ids[t]
        PX[pg, s] = rows[t]
        tok_page[ids[t]] = pg
        tok_slot[ids[t]] = s
    count[pg] = picks.shape[0]
    owner[pg] = node
    dirty[pg] = True
    a = proj[members[pg, 0]]
    b = a
    for s in range(1, count[pg]):
        v = proj[members[pg, s]]
        a = min(a, v)
        b = max(b, v)
    lo[pg] = a
    hi[pg] = b


@njit(nogil=True, cache=True)
def _picks(labels, j):
    """Positions of ``labels`` equal to ``j``, in order."""
    return np.flatnonzero(labels == j)


@njit(nogil=True, cache=True)
def insert_child(i, xi, node, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                 first_page, node_size, tok_page, tok_slot, npages, similar=False):
    """Put point ``i`` (transformed key ``xi``) among ``node``'s children; return the new page
    count.

    Projection pages (``similar`` False): the page whose projection range covers ``proj[i]``
    takes it (pages of a node are disjoint, ordered runs along the projection); a full page is
    first split in half along the projection. Similarity pages (``similar``): the page of the
    nearest sibling takes it; a full page is first split by balanced 2-means, and the point
    joins the half of its nearest sibling. Changed pages are marked dirty.
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
    elif similar:
        pg = _nearest_page(xi, node, PX, first_page, next_page, count)
    else:
        # The last page whose range starts at or below p (or the first page).
        nxt = next_page[pg]
        while nxt >= 0 and lo[nxt] <= p:
            pg = nxt
            nxt = next_page[pg]
    if count[pg] == S:
        # Split, members in projection order: the lower half (projection) or the first balanced
        # 2-means group (similar) stays, the rest goes to a new page right after this one.
        c = count[pg]
        vals = np.empty(c, np.float32)
        for s in range(c):
            vals[s] = proj[members[pg, s]]
        order = np.argsort(vals, kind="mergesort")
        tmp = members[pg, :c][order]
        rows = PX[pg, :c][order]
        if similar:
            labels = balanced_groups(rows, 2, 4)
        else:
            labels = (np.arange(c) >= c // 2).astype(np.int64)
        new = npages
        npages += 1
        _fill_page(pg, node, tmp, rows, _picks(labels, 0), proj, PX, members, count, owner, lo, hi,
                   dirty, tok_page, tok_slot)
        _fill_page(new, node, tmp, rows, _picks(labels, 1), proj, PX, members, count, owner, lo, hi,
                   dirty, tok_page, tok_slot)
        next_page[new] = next_page[pg]
        next_page[pg] = new
        if similar:  # the half holding the point's nearest sibling
            if _page_best(xi, new, PX, count) > _page_best(xi, pg, PX, count):
                pg = new
        elif p >= lo[new]:
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
def cut_node(node, ids, rows, free, used, npages, similar, proj, PX, members, count, next_page, owner, lo, hi,
             dirty, first_page, tok_page, tok_slot):
    """``node`` (without pages) gets its children ``ids`` (transformed keys ``rows``, in
    projection order) as full pages: runs in that order, or with ``similar`` as many balanced
    k-means groups as pages are needed. Pages come from ``free[used:]`` first, then new ones.
    Returns (new page count, free pages used)."""
    S = members.shape[1]
    k = (ids.shape[0] + S - 1) // S
    if similar and k > 1:
        labels = balanced_groups(rows, k, 6)
    else:
        labels = np.arange(ids.shape[0]) // S
    prev = -1
    for j in range(k):
        if used < free.shape[0]:
            pg = free[used]
            used += 1
        else:
            pg = npages
            npages += 1
        _fill_page(pg, node, ids, rows, _picks(labels, j), proj, PX, members, count, owner, lo, hi, dirty,
                   tok_page, tok_slot)
        next_page[pg] = -1
        if prev < 0:
            first_page[node] = pg
        else:
            next_page[prev] = pg
        prev = pg
    return npages, used


@njit(nogil=True, cache=True)
def insert_children(ids, rows, parents, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                    first_page, node_size, tok_page, tok_slot, npages, similar=False):
    """:func:`insert_child` for each point ``ids[t]`` (transformed key ``rows[t]``) under
    ``parents[t]``, in order; return the new page count. One call for a decode step's evicted
    page: a call per point unboxed the tree's thirteen arrays sixteen times."""
    for t in range(ids.shape[0]):
        npages = insert_child(ids[t], rows[t], parents[t], proj, PX, members, count, next_page, owner, lo, hi,
                              dirty, first_page, node_size, tok_page, tok_slot, npages, similar)
    return npages


@njit(nogil=True, cache=True)
def run_end(parents, a):
    """The end of the run of equal ``parents`` that starts at ``a`` (children sorted by parent)."""
    b = a
    while b < parents.shape[0] and parents[b] == parents[a]:
        b += 1
    return b


@njit(nogil=True, cache=True)
def attach_sorted(ids, rows, parents, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                  first_page, node_size, tok_page, tok_slot, npages, similar=False):
    """Bulk attach: ``ids`` sorted by (parent, projection), ``rows[t]`` the transformed key of
    ``ids[t]``; return the new page count.

    A parent that has no children yet gets them as full pages: runs in projection order, or
    with ``similar`` as many balanced k-means groups as pages are needed; any other parent takes
    them one by one through ``insert_child``. Pages built here are marked dirty.
    """
    n = ids.shape[0]
    no_free = np.empty(0, np.int32)
    a = 0
    while a < n:
        node = parents[a]
        b = run_end(parents[:n], a)
        if first_page[node] >= 0:
            for t in range(a, b):
                npages = insert_child(ids[t], rows[t], node, proj, PX, members, count, next_page, owner,
                                      lo, hi, dirty, first_page, node_size, tok_page, tok_slot,
                                      npages, similar)
        else:
            npages, _ = cut_node(node, ids[a:b], rows[a:b], no_free, 0, npages, similar, proj, PX, members,
                                 count, next_page, owner, lo, hi, dirty, first_page, tok_page, tok_slot)
            node_size[node] += b - a
        a = b
    return npages




@njit(nogil=True, cache=True, fastmath=True)
def nearest_among(rows, PX, tok_page, tok_slot, cand, out):
    """For each row ``rows[j]``, the ``cand`` point of largest inner product (exact; the first
    such in ``cand``'s order), in ``out``; a point's transformed key is read where its page
    holds it (``PX[tok_page[i], tok_slot[i]]``), with no copy of the candidates' keys.

    Used for the parents of a few new points (single inserts), where a BLAS call costs more in
    overhead and thread wake-up than the arithmetic.
    """
    D = rows.shape[1]
    n = rows.shape[0]
    best = np.full(n, -np.inf, np.float32)
    for j in range(n):
        out[j] = -1
    for c in range(cand.shape[0]):  # each candidate's key read once, against every row
        pg, s = tok_page[cand[c]], tok_slot[cand[c]]
        for j in range(n):
            acc = np.float32(0.0)
            for d in range(D):
                acc += rows[j, d] * PX[pg, s, d]
            if acc > best[j]:
                best[j] = acc
                out[j] = cand[c]


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
