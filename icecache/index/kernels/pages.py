"""numba kernels that turn ranked points into ranked pages and merge a GQA group's page lists.

References: :func:`ranked_pages` is ``icecache.index.reference.ranked_pages``; :func:`merge_ranked`
is ``icecache.index.select.merge_group_pages``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ... import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)


@njit(nogil=True, cache=True, inline="always")
def node_chain_pages(nodes, first_page, next_page, count, out, n):
    """The pages of ``nodes`` (each node's chain in order) into ``out`` from ``n``: returns (the
    pages listed now in all, the rows they hold)."""
    rows = 0
    for f in range(nodes.shape[0]):
        pg = first_page[nodes[f]]
        while pg >= 0:
            out[n] = pg
            n += 1
            rows += count[pg]
            pg = next_page[pg]
    return n, rows


@njit(nogil=True, cache=True)
def _add_new(out, m, p):
    """Append page ``p`` to ``out[:m]`` unless it is there already; return the new length (lists
    are at most a budget of pages long: a linear scan beats a set)."""
    for j in range(m):
        if out[j] == p:
            return m
    out[m] = p
    return m + 1


@njit(nogil=True, cache=True)
def ranked_pages(ids, tok_page, max_pages):
    """Distinct pages of ``ids`` (best first), in order of their best member, at most ``max_pages``."""
    out = np.empty(min(max_pages, ids.shape[0]), np.int32)
    m = 0
    for t in range(ids.shape[0]):
        if m >= max_pages:
            break
        m = _add_new(out, m, tok_page[ids[t]])
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
                m = _add_new(out, m, lists[r, rank])
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
