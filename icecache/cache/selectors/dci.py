"""IceCache's selector: one DCI-tree per KV head (:class:`~icecache.index.DCITree`), pages of
keys clustered by similarity, searched top-down by the step's query heads (paper, section 4).

With ``token_pick`` (``IceSpec.token_pick`` = m >= 2) the tree's pages are candidates, not the
answer: the search selects m times the budget in pages, the group's attention weights over their
keys are computed exactly (the tree holds the keys), and the budget's best tokens are packed into
pages of their own (:class:`~.tokens.TokenPages`), which the pool loads. The budget still counts
tokens; only the rows that hold the group's attention take pool space. That is for decode
steps; a sparse prefill keeps the tree's whole pages (:meth:`select_prefill`): in its chunks, where
a few positions choose for all of them, and in the prompt's last steps run as decode steps,
whose last one gives the first answer token.

With ``search_every`` (``IceSpec.search_every`` = r > 1) a decode step reuses the previous
step's search result while the tree is unchanged, for at most r steps in a row: the same pages,
or with ``token_pick`` the same candidate pages, among which the step's own query picks its
tokens. A step that inserts keys into the tree, a prefill step and a new budget search again.

With ``carry_pages`` = C a decode step's search ranks the pages the layer's previous search
ranked best (the prompt's last step's choice, then each decode step's best C, at least as many
as it selects; with ``token_pick`` candidate pages) beside the pages its walk reaches, scored by
the step's own queries; the step selects the head of that ranking. A page that an earlier, wider
search found (the prompt's last steps search every key) stays while the queries still rank it
among their best C, however narrow the decode beam; a page they stop wanting drops out.
"""

from __future__ import annotations

import os

import numpy as np

from ...index import DCITree
from ...index.walk import select_layer
from ..kernels import pick_rows
from .base import HeadIndexes, register
from .tokens import TokenPages, group_weights, top_tokens

# A layer's KV heads queried by one parallel numba call (index.walk.select_layer); 0: one by one.
PARALLEL_HEADS = os.environ.get("ICECACHE_PARALLEL_HEADS", "1") != "0"


@register("dci")
class DCISelector(HeadIndexes):
    def __init__(self, spec):
        super().__init__(spec)
        self.picks: list[TokenPages] = []  # token_pick: the chosen tokens' pages per KV head
        self.held: tuple | None = None  # search_every: ((pages, wide), pages per KV head)
        self.held_age = 0  # decode steps that used ``held``
        self.carried: list[np.ndarray] | None = None  # carry_pages: the last choice's pages per KV head

    @property
    def picking(self) -> bool:
        return self.spec.token_pick > 0  # validated: 0 (off) or 2 and more

    def build(self, prompt_keys, lo: int, hi: int, capacity: int, middle=None) -> None:
        super().build(prompt_keys, lo, hi, capacity, middle)
        # a new index, a new pool: no token chosen yet; a table holds the largest selection
        # any step makes (the pool's size), as a token selector's does
        pages = max(1, self.spec.pool_pages)
        self.picks = [TokenPages(self.spec.page_size, pages) for _ in self.indexes] if self.picking else []
        self.held = None
        self.carried = None

    def insert(self, keys) -> None:
        self.held = None  # new keys may belong in pages the held search did not return
        super().insert(keys)

    def new_index(self, head: int, capacity: int) -> DCITree:
        return DCITree(self.head_dim, self.spec.index, capacity=capacity)

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        want = self.spec.token_pick * max_pages if self.picking else max_pages
        ranked = self.carry(self.searched(queries, max(want, self.spec.carry_pages), wide))
        pages = ranked if self.spec.carry_pages <= want else [p[:want] for p in ranked]
        if not self.picking:
            return pages
        take = max_pages * self.spec.page_size
        return [self.as_picks(h, picked(tree, queries[h], pages[h], take), max_pages)
                for h, tree in enumerate(self.indexes)]

    def select_prefill(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        """A sparse prefill's choice (a chunk, or one of the prompt's last steps): the tree's
        whole pages even with ``token_pick`` (then packed into the pick tables, so that one page
        table serves every step). Tokens picked for a chunk's few choosing positions lost 16k
        passkeys that whole pages kept; picked at the prompt's last steps, they lost 32k and 64k
        passkeys that pages there (and picks after them) found (docs/results.md, "Accuracy
        beyond the trained context"). ``prefill_beam`` (nodes per level, when set) widens the search to at least
        that beam."""
        self.held = None
        n = max((tree.n for tree in self.indexes), default=0)
        if self.spec.prefill_beam and n:  # nodes per level, as a share of the keys
            wide = max(wide, self.spec.prefill_beam / n)
        pages = self.carry(self.select_pages(queries, max_pages, wide))
        if not self.picking:
            return pages
        return [self.as_picks(h, page_members(tree, pages[h]), max_pages) for h, tree in enumerate(self.indexes)]

    def searched(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        """:meth:`select_pages` for a decode step, or the held result of an earlier step's
        search when ``search_every`` allows it (same request, tree unchanged since)."""
        key = (max_pages, wide)
        if self.held is not None and self.held[0] == key and self.held_age < self.spec.search_every:
            self.held_age += 1
            return self.held[1]
        pages = self.select_pages(queries, max_pages, wide, self.carried)
        self.held, self.held_age = ((key, pages), 1) if self.spec.search_every > 1 else (None, 0)
        return pages

    def select_pages(self, queries: np.ndarray, max_pages: int, wide: float = 0.0,
                     extra: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The tree's own pages: per KV head at most ``max_pages``, GQA-merged; ``extra[h]``:
        pages ranked with those head h's walk reaches (``carry_pages``)."""
        k = max_pages * self.spec.page_size
        if not PARALLEL_HEADS:
            return [index.select_group(queries[h], k, max_pages, wide, None if extra is None else extra[h])
                    for h, index in enumerate(self.indexes)]
        return select_layer(self.indexes, queries, k, max_pages, wide, extra)

    def carry(self, pages: list[np.ndarray]) -> list[np.ndarray]:
        """Remember ``pages`` (a search's ranked tree pages per KV head) for the next search."""
        if self.spec.carry_pages > 0:
            self.carried = pages
        return pages

    def as_picks(self, head: int, rows: np.ndarray, max_pages: int) -> np.ndarray:
        """Make host ``rows`` (at most ``max_pages`` pages' worth) head ``head``'s chosen tokens;
        the ids of the pick table's pages holding them."""
        table = self.picks[head]
        chosen = table.choose(rows)
        if len(chosen) > max_pages:  # kept slots spread over more pages than this step may use
            table.clear()
            chosen = table.choose(rows)
        return chosen

    @property
    def has_tree(self) -> bool:
        return bool(self.indexes)

    def tree_pages(self, head: int):
        """Head ``head``'s tree pages, whatever the pool loads (``rest_estimate``): (members,
        count, versions, pages in use, the tree page of each host row (-1: none))."""
        tree = self.indexes[head]
        return tree.members, tree.count, self.versions[head], tree.npages, tree.tok_page

    def page_table(self, head: int):
        if self.picking:
            return self.picks[head].table()
        return super().page_table(head)

    def release(self) -> None:
        super().release()
        self.picks = []
        self.held = None
        self.carried = None


def page_members(tree: DCITree, pages: np.ndarray) -> np.ndarray:
    """The point ids (host rows) held by the tree's pages ``pages``."""
    members = tree.members[pages]
    return members[np.arange(members.shape[1]) < tree.count[pages][:, None]]


def picked(tree: DCITree, queries: np.ndarray, pages: np.ndarray, take: int) -> np.ndarray:
    """The ``take`` members of the tree's ``pages`` with the most of the group's attention:
    each query's (G, d) softmax over the candidates' keys, summed over the group (all when they
    fit), in candidate order. One numba pass (:func:`~..kernels.pick_rows`)."""
    return pick_rows(tree.PX, tree.members, tree.count, np.asarray(pages, np.int64),
                     np.ascontiguousarray(queries, np.float32), take, float(tree.d) ** -0.5)


def pick_tokens(tree: DCITree, queries: np.ndarray, pages: np.ndarray, take: int) -> np.ndarray:
    """NumPy reference of :func:`picked` (the same contract, tested equal)."""
    rows = page_members(tree, pages)
    if len(rows) <= take:
        return rows
    keys = tree.rows(rows)[:, : tree.d]
    return rows[top_tokens(group_weights(queries, keys, tree.d ** -0.5), take)]
