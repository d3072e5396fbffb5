"""numba kernels that build a DCI-tree: place points in their parent's pages (with splits), and
find parents (exactly among few candidates, or by a walk down the tree).

Checked by the tree's structural invariants after builds and random inserts
(tests/test_index.py::check_invariants); :func:`nearest_among` against
``icecache.index.reference.nearest_inner``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

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
def _nearest_page(xi, node, PX, first_page, next_page, count):
    """The page of ``node`` holding the child of largest inner product with ``xi``."""
    D = PX.shape[2]
    best = -np.inf
    arg = first_page[node]
    pg = arg
    while pg >= 0:
        for s in range(count[pg]):
            acc = np.float32(0.0)
            for d in range(D):
                acc += PX[pg, s, d] * xi[d]
            if acc > best:
                best = acc
                arg = pg
        pg = next_page[pg]
    return arg


@njit(nogil=True, cache=True)
def _set_range(pg, proj, members, count, lo, hi):
    """lo/hi of page ``pg``: its members' projection range."""
    a = proj[members[pg, 0]]
    b = a
    for s in range(1, count[pg]):
        v = proj[members[pg, s]]
        a = min(a, v)
        b = max(b, v)
    lo[pg] = a
    hi[pg] = b


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
    if similar and first_page[node] >= 0:
        return _insert_similar(i, xi, node, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                               first_page, node_size, tok_page, tok_slot, npages)
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
def _insert_similar(i, xi, node, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                    first_page, node_size, tok_page, tok_slot, npages):
    """``insert_child`` for similarity pages, into a node that has pages."""
    S = members.shape[1]
    pg = _nearest_page(xi, node, PX, first_page, next_page, count)
    if count[pg] == S:
        # Split by balanced 2-means (seeded at the projection's ends), the second half to a new
        # page right after this one.
        c = count[pg]
        tmp = members[pg, :c].copy()
        rows = PX[pg, :c].copy()
        vals = np.empty(c, np.float32)
        for s in range(c):
            vals[s] = proj[tmp[s]]
        order = np.argsort(vals, kind="mergesort")
        labels = balanced_groups(rows[order], 2, 4)
        new = npages
        npages += 1
        a = b = 0
        for t in range(c):
            s = order[t]
            if labels[t] == 0:
                members[pg, a] = tmp[s]
                PX[pg, a] = rows[s]
                tok_page[tmp[s]] = pg
                tok_slot[tmp[s]] = a
                a += 1
            else:
                members[new, b] = tmp[s]
                PX[new, b] = rows[s]
                tok_page[tmp[s]] = new
                tok_slot[tmp[s]] = b
                b += 1
        count[pg] = a
        count[new] = b
        next_page[new] = next_page[pg]
        next_page[pg] = new
        owner[new] = node
        dirty[pg] = True
        dirty[new] = True
        _set_range(pg, proj, members, count, lo, hi)
        _set_range(new, proj, members, count, lo, hi)
        # the half holding the point's nearest sibling
        D = PX.shape[2]
        best = -np.inf
        halves = np.array([pg, new], np.int64)
        for q in halves:
            for s in range(count[q]):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += PX[q, s, d] * xi[d]
                if acc > best:
                    best = acc
                    pg = q
    s = count[pg]
    members[pg, s] = i
    PX[pg, s] = xi
    count[pg] = s + 1
    tok_page[i] = pg
    tok_slot[i] = s
    p = proj[i]
    if p < lo[pg]:
        lo[pg] = p
    if p > hi[pg]:
        hi[pg] = p
    dirty[pg] = True
    node_size[node] += 1
    return npages


@njit(nogil=True, cache=True)
def attach_sorted(ids, rows, parents, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                  first_page, node_size, tok_page, tok_slot, npages, similar=False):
    """Bulk attach: ``ids`` sorted by (parent, projection), ``rows[t]`` the transformed key of
    ``ids[t]``; return the new page count.

    A parent that has no children yet gets them as full pages: runs in projection order, or
    with ``similar`` as many balanced k-means groups as pages are needed; any other parent takes
    them one by one through ``insert_child``. Pages built here are marked dirty.
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
                                      npages, similar)
        elif similar and b - a > S:
            k = (b - a + S - 1) // S
            labels = balanced_groups(rows[a:b], k, 6)
            prev = -1
            for j in range(k):
                pg = npages
                npages += 1
                m = 0
                for t in range(a, b):
                    if labels[t - a] == j:
                        members[pg, m] = ids[t]
                        PX[pg, m] = rows[t]
                        tok_page[ids[t]] = pg
                        tok_slot[ids[t]] = m
                        m += 1
                count[pg] = m
                owner[pg] = node
                next_page[pg] = -1
                dirty[pg] = True
                _set_range(pg, proj, members, count, lo, hi)
                if prev < 0:
                    first_page[node] = pg
                else:
                    next_page[prev] = pg
                prev = pg
            node_size[node] += b - a
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
