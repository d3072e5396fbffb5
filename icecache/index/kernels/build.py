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
