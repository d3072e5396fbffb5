"""numba kernels of the tree's Lloyd refinement (``DCITree.refine``): the bottom level's points
move to the parent whose children's mean is nearest, then the changed parents' children are cut
into pages again.

Checked by the tree's invariants after refinements and against NumPy in tests/test_index.py
(centres, the nearest-candidate step, the k-means objective never rising).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ... import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from .build import cut_node, run_end
from .pages import node_chain_pages


@njit(nogil=True, cache=True)
def group_centres(rows, group, own):
    """Mean of the ``rows`` of each group (``group[j]`` in 0..len(own)-1); a group without rows
    keeps ``own[g]`` (the parent's own transformed key). Returns (centres, sizes)."""
    k, D = own.shape
    sums = np.zeros((k, D), np.float64)
    sizes = np.zeros(k, np.int64)
    for j in range(rows.shape[0]):
        g = group[j]
        sizes[g] += 1
        for d in range(D):
            sums[g, d] += rows[j, d]
    out = np.empty((k, D), np.float32)
    for g in range(k):
        if sizes[g]:
            for d in range(D):
                out[g, d] = sums[g, d] / sizes[g]
        else:
            out[g] = own[g]
    return out, sizes


@njit(nogil=True, cache=True, fastmath=True)
def nearest_candidate(rows, group, cand, row_of, centres, csq, out):
    """For each row ``j``, the group among ``cand[row_of[group[j]]]`` (the candidate groups of
    its current group, which include the group itself) whose centre is nearest in squared
    Euclidean distance (``csq``: the centres' squared norms), in ``out``; ties keep the current
    group. Returns how many rows changed group."""
    D = rows.shape[1]
    moved = 0
    for j in range(rows.shape[0]):
        g = group[j]
        best_g = g
        acc = np.float32(0.0)
        for d in range(D):
            acc += rows[j, d] * centres[g, d]
        best = csq[g] - 2.0 * acc
        c = cand[row_of[g]]
        for t in range(c.shape[0]):
            h = c[t]
            if h == g:
                continue
            acc = np.float32(0.0)
            for d in range(D):
                acc += rows[j, d] * centres[h, d]
            dist = csq[h] - 2.0 * acc
            if dist < best:
                best = dist
                best_g = h
        out[j] = best_g
        if best_g != g:
            moved += 1
    return moved


@njit(nogil=True, cache=True)
def node_pages(nodes, first_page, next_page, count):
    """Every page of ``nodes`` (walking each node's page chain), in order (a page has one owner
    node, so they are at most every page)."""
    out = np.empty(next_page.shape[0], np.int32)
    n, _ = node_chain_pages(nodes, first_page, next_page, count, out, 0)
    return out[:n]


@njit(nogil=True, cache=True)
def node_children(nodes, first_page, next_page, members, count):
    """The children of ``nodes`` (from their pages) and, for each, the index of its node in
    ``nodes``."""
    total = 0
    for t in range(nodes.shape[0]):
        pg = first_page[nodes[t]]
        while pg >= 0:
            total += count[pg]
            pg = next_page[pg]
    ids = np.empty(total, np.int32)
    group = np.empty(total, np.int64)
    m = 0
    for t in range(nodes.shape[0]):
        pg = first_page[nodes[t]]
        while pg >= 0:
            for s in range(count[pg]):
                ids[m] = members[pg, s]
                group[m] = t
                m += 1
            pg = next_page[pg]
    return ids, group


@njit(nogil=True, cache=True)
def attach_fresh(ids, rows, parents, free, proj, PX, members, count, next_page, owner, lo, hi, dirty,
                 first_page, node_size, tok_page, tok_slot, npages, similar):
    """Like ``attach_sorted`` for parents that have no children (the caller emptied them): each
    parent's children (``ids`` sorted by parent, then projection) become full pages, runs along
    the projection or balanced k-means groups (``similar``). Pages come from ``free`` first,
    then new ones. Returns (new page count, free pages used)."""
    n = ids.shape[0]
    used = 0
    a = 0
    while a < n:
        node = parents[a]
        b = run_end(parents[:n], a)
        npages, used = cut_node(node, ids[a:b], rows[a:b], free, used, npages, similar, proj, PX, members,
                                count, next_page, owner, lo, hi, dirty, first_page, tok_page, tok_slot)
        node_size[node] = b - a
        a = b
    return npages, used
