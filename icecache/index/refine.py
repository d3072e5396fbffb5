"""Lloyd refinement of a DCI-tree's bottom level (:meth:`~icecache.index.tree.DCITree.refine`):
the level-0 points move to the level-1 parent whose children's mean is nearest, then the changed
parents' children are cut into pages again. The numba steps are in
:mod:`icecache.index.kernels.refine`; these functions choose the points and candidates, run the
passes and write the result into the tree's arrays.
"""

from __future__ import annotations

import numpy as np

from .kernels import refine as refine_kernels


def refine_bottom(tree, nodes: np.ndarray | None = None, passes: int = 1) -> int:
    """:meth:`DCITree.refine <icecache.index.tree.DCITree.refine>` of ``tree``: Lloyd passes
    over the children of ``nodes`` (``None``: every level-1 point); returns how many points
    changed parent."""
    if tree.top_level < 1 or passes <= 0:
        return 0
    tree._own()
    level1 = np.sort(tree._level_ids(1))  # their node ids are + 1
    if not len(level1):
        return 0
    if nodes is None:
        scope = level1 + 1
    else:
        scope = np.unique(np.asarray(nodes, np.int64))
        scope = scope[scope > 0]
        scope = scope[tree.level[scope - 1] == 1].astype(np.int32)
    if not len(scope):
        return 0
    C = min(tree.cfg.refine_candidates, len(level1))
    own = tree.rows(level1)
    ids, group = refine_kernels.node_children(scope.astype(np.int32), tree.first_page, tree.next_page,
                                              tree.members, tree.count)
    centres, _ = refine_kernels.group_centres(tree.rows(ids), group, tree.rows(scope - 1))
    # Candidates: the level-1 points of largest inner product with the mean (all transformed
    # keys have the same norm, so that is the nearest), the parent itself always among them.
    cand = np.empty((len(scope), C), np.int64)
    for lo in range(0, len(scope), 1024):
        sims = centres[lo : lo + 1024] @ own.T
        cand[lo : lo + len(sims)] = level1[np.argpartition(-sims, C - 1, axis=1)[:, :C]] + 1
    mine = scope.astype(np.int64)
    has = (cand == mine[:, None]).any(1)
    cand[~has, -1] = mine[~has]
    universe = np.unique(np.concatenate([mine, cand.ravel()])).astype(np.int32)
    # In universe indices; a parent outside the scope has only itself (its children stay).
    cand_u = np.repeat(np.arange(len(universe))[:, None], C, axis=1)
    cand_u[np.searchsorted(universe, mine)] = np.searchsorted(universe, cand)
    ids, group = refine_kernels.node_children(universe, tree.first_page, tree.next_page, tree.members,
                                              tree.count)
    if not len(ids):
        return 0
    rows = tree.rows(ids)
    own_u = tree.rows(universe - 1)
    start = group.copy()
    row_of = np.arange(len(universe))
    out = np.empty(len(ids), np.int64)
    centres, _ = refine_kernels.group_centres(rows, group, own_u)
    for _ in range(passes):
        csq = np.einsum("ij,ij->i", centres, centres).astype(np.float32)
        moved = refine_kernels.nearest_candidate(rows, group, cand_u, row_of, centres, csq, out)
        group[:] = out
        centres, _ = refine_kernels.group_centres(rows, group, own_u)
        if not moved:
            break
    changed = group != start
    recut = np.isin(universe, scope)
    recut[group[changed]] = True
    recut[start[changed]] = True
    recut_nodes(tree, universe[recut], ids, universe[group], rows)
    return int(changed.sum())


def recut_nodes(tree, nodes: np.ndarray, pts: np.ndarray, new_parent: np.ndarray, rows: np.ndarray) -> None:
    """Give ``pts`` (transformed keys ``rows``) their ``new_parent`` (node ids) and cut the
    children of ``nodes`` (which hold every point whose parent changed, before and after)
    into pages again."""
    nodes = nodes.astype(np.int32)
    old_pages = refine_kernels.node_pages(nodes, tree.first_page, tree.next_page, tree.count)
    tree.parent[pts] = new_parent
    keep = np.isin(new_parent, nodes)
    ids, rows = pts[keep], rows[keep]
    order = np.lexsort((tree.proj[ids], tree.parent[ids]))
    ids, rows = ids[order], np.ascontiguousarray(rows[order])
    S = tree.cfg.page_size
    _, sizes = np.unique(tree.parent[ids], return_counts=True)
    free = np.concatenate([old_pages, tree._free]).astype(np.int32)
    need = int((-(-sizes // S)).sum())
    tree._ensure_pages(max(0, need - len(free)))
    tree.first_page[nodes] = -1
    tree.node_size[nodes] = 0
    tree.npages, used = refine_kernels.attach_fresh(
        ids, rows, tree.parent[ids].astype(np.int32), free, *tree._page_state(), tree.npages,
        tree._similar)
    left = free[used:]
    tree.count[left] = 0
    tree.owner[left] = -2  # retired until a later refinement fills it
    tree.next_page[left] = -1
    tree.dirty[left] = True
    tree._free = left
