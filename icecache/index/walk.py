"""Shared group walks over several trees: the per-thread scratch they scan into, and a layer's
KV heads walked in parallel by one numba call (:func:`select_layer`)."""

from __future__ import annotations

import threading

import numpy as np

from . import kernels

# Scanned rows a group walk's scratch starts with (it grows when a walk needs more).
WALK_ROWS, WALK_ROWS_PER_BEAM = 8192, 64
_scratch = threading.local()


def walk_rows(n: int, beam: int, g: int) -> int:
    """Scanned rows a group walk's scratch starts with."""
    return min(n, max(WALK_ROWS, WALK_ROWS_PER_BEAM * beam * g))


def marks(n: int, slot: int = 0) -> np.ndarray:
    """This thread's stamps for slot ``slot``: int64, at least ``n + 1`` (row or node i at i + 1),
    slot 0 a counter that each user raises past every stamp it writes, so that stamps stay
    unique across the trees and calls that share it (a group walk marks the nodes it expanded,
    the token packing the rows it wants, :func:`~icecache.cache.kernels.choose_tokens`)."""
    arrays = getattr(_scratch, "arrays", None)
    if arrays is None:
        arrays = _scratch.arrays = {}
    mark = arrays.get(("mark", slot))
    if mark is None or mark.shape[0] < n + 1:
        fresh = np.zeros(max(n + 1, 2 * (0 if mark is None else mark.shape[0])), np.int64)
        if mark is not None:
            fresh[0] = mark[0]
        arrays[("mark", slot)] = mark = fresh
    return mark


def group_scratch(n: int, g: int, rows: int, slot: int = 0):
    """This thread's scratch for a group walk, shared by every tree it queries: ``mark`` (one
    int64 per node, :func:`marks`), and room for ``rows`` scanned rows (ids, pages, ``g`` scores
    each). Sized by what a walk scans, not by the tree (a per-tree copy of ``n`` x ``g`` scores
    was the largest part of a long sparse prefill's index memory). Walks that run at the same
    time (a layer's heads in parallel) each take their own ``slot``."""
    mark = marks(n, slot)
    arrays = _scratch.arrays
    rows_now = arrays.get(("rows", g, slot))
    if rows_now is None or rows_now[0].shape[0] < rows:
        size = max(rows, 2 * (0 if rows_now is None else rows_now[0].shape[0]))
        rows_now = arrays[("rows", g, slot)] = (np.empty(size, np.int32), np.empty(size, np.int32),
                                                np.empty((size, g), np.float32))
    return (mark, *rows_now)


def select_layer(trees: list, queries: np.ndarray, k: int, max_pages: int,
                 wide: float = 0.0, extra: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """``trees[h].select_group(queries[h], k, max_pages, wide, extra[h])`` for every KV head h of a layer,
    the heads walked in parallel by one numba call (per-tree calls when a tree is empty or does
    not use shared walks).

    queries: (H, G, d). On this 2-core CPU a decode step's index queries are memory bound (a
    core streams pages at about 8.5 GB/s), so the second core cuts their time by a third.
    """
    return _layer(trees, queries, k, max_pages, wide, extra, 0)[0]


def pick_layer(trees: list, queries: np.ndarray, take: int, max_pages: int, wide: float = 0.0,
               extra: list[np.ndarray] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``trees[h].pick_group(queries[h], take, max_pages, wide, extra[h])`` for every KV head h of
    a layer in the one parallel call of :func:`select_layer`: per head its ranked pages (at most
    ``max_pages``) and the ``take`` tokens its walk scanned with the most of the group's
    estimated attention."""
    return _layer(trees, queries, max_pages * trees[0].cfg.page_size, max_pages, wide, extra, take)


def _layer(trees, queries, k, max_pages, wide, extra, take):
    """(pages, tokens) per head of :func:`select_layer` (``take`` 0: no tokens) or :func:`pick_layer`."""
    H = len(trees)
    extra = extra if extra is not None else [None] * H

    def alone(h):
        if take:
            return trees[h].pick_group(queries[h], take, max_pages, wide, extra[h])
        return trees[h].select_group(queries[h], k, max_pages, wide, extra[h]), None

    if H < 2 or not all(t.cfg.shared_walk and t.n > 0 for t in trees):
        got = [alone(h) for h in range(H)]
        return [g[0] for g in got], [g[1] for g in got]
    if any(e is not None and len(e) for e in extra) and k < max_pages * trees[0].cfg.page_size:
        raise ValueError("extra pages need the shared walk's page path")
    n_extra = np.array([0 if e is None else len(e) for e in extra], np.int64)
    extras = np.zeros((H, max(1, int(n_extra.max()))), np.int32)
    for h, e in enumerate(extra):
        extras[h, : n_extra[h]] = e if e is not None else ()
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    g = queries.shape[1]
    beams = np.array([t.beam_for(wide) for t in trees], np.int64)
    out = np.empty((H, max_pages), np.int32)
    lens = np.zeros(H, np.int64)
    ok = np.zeros(H, np.bool_)
    tok_out = np.empty((H, max(1, take)), np.int32)
    tok_lens = np.zeros(H, np.int64)
    scratch = [group_scratch(t.n, g, walk_rows(t.n, int(beams[h] + n_extra[h]), g), slot=h)
               for h, t in enumerate(trees)]
    keys = [t.walk_keys() for t in trees]
    kernels.select_heads_shared(
        queries, k, max_pages, beams, tuple(w[0] for w in keys), tuple(w[1] for w in keys),
        np.array([t.top_level for t in trees], np.int64), tuple(t.first_page for t in trees),
        tuple(t.next_page for t in trees), tuple(t.members for t in trees),
        tuple(t.count for t in trees), tuple(t.node_size for t in trees),
        tuple(t.tok_page for t in trees), tuple(s[0] for s in scratch), tuple(s[1] for s in scratch),
        tuple(s[2] for s in scratch), tuple(s[3] for s in scratch), out, lens, ok, extras, n_extra,
        tuple(t.owner for t in trees), *trees[0].merge_args(), take, tok_out, tok_lens)
    # a head whose scratch was too short walks again alone, with room to grow
    got = [(out[h, : lens[h]].copy(), tok_out[h, : tok_lens[h]].copy()) if ok[h] else alone(h) for h in range(H)]
    return [g[0] for g in got], [g[1] for g in got]
