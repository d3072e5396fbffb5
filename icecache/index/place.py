"""Placing a level's new points in a DCI-tree (IceCache paper, section 4, Algorithm 2): each
point's parent is the nearest point one level up, and it joins that parent's pages (bulk batches
sorted along the projection and cut into full pages, single points inserted with splits). A new
top level first takes the root's children, which then move under it.

Functions of a :class:`~icecache.index.tree.DCITree`, which calls :func:`place_level` from
:meth:`~icecache.index.tree.DCITree.insert`, one level at a time, top-down; they read and write the
tree's arrays in place.
"""

from __future__ import annotations

import numpy as np

from . import kernels

EXACT_PARENT_PAIRS = 1 << 24  # batch parent search by matrix product up to this many pairs


def place_level(tree, ids: np.ndarray, lvl: int, rows: np.ndarray, cheap: bool = False) -> None:
    """Attach points of one level (transformed keys ``rows``): under the root at the top,
    else under their parents (``cheap``: a bulk attach cuts new nodes' pages along the
    projection whatever the page rule; a refinement cuts them again)."""
    root = np.zeros(len(ids), np.int32)
    if lvl > tree.top_level:
        old_top = tree.top_level
        tree.top_level = lvl
        # The root's children (the old top level) move under the new, higher level.
        orphans, orows = detach_root(tree)
        attach(tree, ids, root, rows)
        if len(orphans):
            attach(tree, orphans, nearest_parents(tree, orphans, old_top, orows), orows)
    elif lvl == tree.top_level:
        attach(tree, ids, root, rows)
    else:
        attach(tree, ids, nearest_parents(tree, ids, lvl, rows), rows, cheap)


def detach_root(tree) -> tuple[np.ndarray, np.ndarray]:
    """Retire the root's pages; return the points they held and their transformed keys
    (the caller re-attaches them)."""
    held, rows = [], []
    pg = tree.first_page[0]
    while pg >= 0:
        held.append(tree.members[pg, : tree.count[pg]].copy())
        rows.append(tree.PX[pg, : tree.count[pg]].copy())
        for s in range(tree.count[pg]):
            tree.tok_page[tree.members[pg, s]] = -1
        tree.count[pg] = 0
        tree.dirty[pg] = True
        nxt = tree.next_page[pg]
        tree.next_page[pg] = -1
        tree.owner[pg] = -2  # retired
        pg = nxt
    tree.first_page[0] = -1
    tree.node_size[0] = 0
    retired = np.flatnonzero(tree.owner[: tree.npages] == -2).astype(np.int32)
    tree._free = np.union1d(tree._free, retired).astype(np.int32)  # a refinement may reuse them
    if not held:
        return np.empty(0, np.int32), np.empty((0, tree.D), np.float32)
    return np.concatenate(held), np.concatenate(rows)


def nearest_parents(tree, ids: np.ndarray, lvl: int, rows: np.ndarray) -> np.ndarray:
    """Node ids of the nearest points one level up (the nearest existing higher level) for
    points ``ids`` with transformed keys ``rows``."""
    up = lvl + 1
    while up <= tree.top_level and not len(tree._level_ids(up)):
        up += 1
    if up > tree.top_level:
        return np.zeros(len(ids), np.int32)
    cand = tree._level_ids(up)
    few = len(ids) <= 256  # single inserts: exact only over a small level
    limit = tree.cfg.exact_parent_max if not few else min(tree.cfg.exact_parent_max, 512)
    # A batch (an evicted prefill chunk) against a larger level: exact through one matrix
    # product while that stays about a GFLOP (cheaper than a tree walk per point, and exact).
    batch = not few and len(cand) * len(ids) <= EXACT_PARENT_PAIRS
    if len(cand) <= limit or up == tree.top_level or batch:
        out = np.empty(len(ids), np.int32)
        if few:
            kernels.nearest_among(rows, tree.PX, tree.tok_page, tree.tok_slot, cand, out)
            return out + 1
        C = tree.rows(cand)
        step = max(256, (1 << 24) // max(1, len(cand)))  # a product of at most 64 MB at a time
        for lo in range(0, len(ids), step):
            block = rows[lo : lo + step]
            out[lo : lo + len(block)] = cand[np.argmax(block @ C.T, axis=1)] + 1
        return out
    out = np.empty(len(ids), np.int32)
    sid, ssc = tree._scratch()
    kernels.parents_by_tree(
        rows, tree.u, tree.top_level, up, tree.cfg.parent_beam,
        tree.cfg.visit_frac, tree.PX, tree.level, tree.first_page, tree.next_page, tree.members,
        tree.count, tree.lo, tree.hi, tree.node_size, sid, ssc, out)
    return out


def attach(tree, ids: np.ndarray, parents: np.ndarray, rows: np.ndarray, cheap: bool = False) -> None:
    """Give points ``ids`` (transformed keys ``rows``) their ``parents`` (node ids) and put them
    in those parents' pages, first making room for the pages that can take."""
    tree.parent[ids] = parents
    if len(ids) <= 64:  # point by point: each point makes at most one page (split or first)
        tree._ensure_pages(len(ids) + 1)
    else:  # bulk: a node without children gets ceil(c / S); any other at most one per point
        nodes, counts = np.unique(parents, return_counts=True)
        fresh = tree.first_page[nodes] < 0
        S = tree.cfg.page_size
        tree._ensure_pages(int((-(-counts[fresh] // S)).sum() + counts[~fresh].sum()) + 1)
    if len(ids) > 64:
        # Bulk: children of one node in projection order; a node without children gets them
        # as full pages (point-by-point insertion in sorted order would leave pages half full).
        order = np.lexsort((tree.proj[ids], parents))
        tree.npages = kernels.attach_sorted(
            ids[order].astype(np.int32), np.ascontiguousarray(rows[order]),
            parents[order].astype(np.int32), *tree._page_state(), tree.npages, tree._similar and not cheap)
        return
    tree.npages = kernels.insert_children(np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(rows, np.float32),
                                          np.ascontiguousarray(parents, np.int32), *tree._page_state(), tree.npages,
                                          tree._similar)
