"""IceCache's selector: one DCI-tree per KV head (:class:`~icecache.index.DCITree`), pages of
keys clustered by similarity, searched top-down by the step's query heads (paper, section 4).
One numba call walks all of a layer's KV heads in parallel (:func:`~...index.walk.select_layer`).

With ``carry_pages`` = C a decode step's search ranks the pages the layer's previous search
ranked best (the prompt's last step's choice, then each decode step's best C, at least as many
as it selects) beside the pages its walk reaches, scored by the step's own queries; the step
selects the head of that ranking. A page that an earlier, wider search found (the prompt's last
steps search every key) stays while the queries still rank it among their best C, however
narrow the decode beam; a page they stop wanting drops out.
"""

from __future__ import annotations

import numpy as np

from ...index import DCITree
from ...index.walk import select_layer
from ..kernels import pick_rows
from .base import HeadIndexes, register
from .tokens import group_weights, top_tokens


@register("dci")
class DCISelector(HeadIndexes):
    def __init__(self, spec):
        super().__init__(spec)
        self.carried: list[np.ndarray] | None = None  # carry_pages: the last choice's pages per KV head

    def build(self, prompt_keys, lo: int, hi: int, capacity: int, middle=None) -> None:
        super().build(prompt_keys, lo, hi, capacity, middle)
        self.carried = None  # a new index: nothing to carry

    def new_index(self, head: int, capacity: int) -> DCITree:
        return DCITree(self.head_dim, self.spec.index, capacity=capacity)

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        ranked = self.carry(self.select_pages(queries, max(max_pages, self.spec.carry_pages), wide, self.carried))
        return ranked if self.spec.carry_pages <= max_pages else [p[:max_pages] for p in ranked]

    def select_prefill(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        """A sparse prefill's choice (a chunk, or one of the prompt's last steps): the tree's
        pages, with ``prefill_beam`` (nodes per level, when set) widening the search to at least
        that beam."""
        n = max((tree.n for tree in self.indexes), default=0)
        if self.spec.prefill_beam and n:  # nodes per level, as a share of the keys
            wide = max(wide, self.spec.prefill_beam / n)
        return self.carry(self.select_pages(queries, max_pages, wide))

    def select_pages(self, queries: np.ndarray, max_pages: int, wide: float = 0.0,
                     extra: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The tree's own pages: per KV head at most ``max_pages``, GQA-merged; ``extra[h]``:
        pages ranked with those head h's walk reaches (``carry_pages``). The heads are walked in
        parallel by one numba call; its reference is each tree's own
        :meth:`~...index.DCITree.select_group` (tests/test_index.py)."""
        return select_layer(self.indexes, queries, max_pages * self.spec.page_size, max_pages, wide, extra)

    def carry(self, pages: list[np.ndarray]) -> list[np.ndarray]:
        """Remember ``pages`` (a search's ranked tree pages per KV head) for the next search."""
        if self.spec.carry_pages > 0:
            self.carried = pages
        return pages

    @property
    def has_tree(self) -> bool:
        return bool(self.indexes)

    def tree_pages(self, head: int):
        """Head ``head``'s tree pages, whatever the pool loads (``rest_estimate``): (members,
        count, versions, pages in use, the tree page of each host row (-1: none))."""
        tree = self.indexes[head]
        return tree.members, tree.count, self.versions[head], tree.npages, tree.tok_page

    def release(self) -> None:
        super().release()
        self.carried = None


def page_members(tree: DCITree, pages: np.ndarray) -> np.ndarray:
    """The point ids (host rows) held by the tree's pages ``pages``."""
    members = tree.members[pages]
    return members[np.arange(members.shape[1]) < tree.count[pages][:, None]]


def picked(tree: DCITree, queries: np.ndarray, pages: np.ndarray, take: int) -> np.ndarray:
    """``icecache bench index --pick``'s token choice (``ice_pickM``, measured beside the pages
    the cache loads): the ``take`` members of the tree's ``pages`` with the most of the group's
    attention: each query's (G, d) softmax over the candidates' keys, summed over the group (all
    when they fit), in candidate order. One numba pass (:func:`~..kernels.pick_rows`)."""
    return pick_rows(tree.PX, tree.members, tree.count, np.asarray(pages, np.int64),
                     np.ascontiguousarray(queries, np.float32), take, float(tree.d) ** -0.5)


def pick_tokens(tree: DCITree, queries: np.ndarray, pages: np.ndarray, take: int) -> np.ndarray:
    """NumPy reference of :func:`picked` (the same contract, tested equal)."""
    rows = page_members(tree, pages)
    if len(rows) <= take:
        return rows
    keys = tree.rows(rows)[:, : tree.d]
    return rows[top_tokens(group_weights(queries, keys, tree.d ** -0.5), take)]
