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

import functools
from dataclasses import dataclass

import numpy as np

from ...index import DCITree, IndexConfig
from ...index.config import MERGES, WALK_KEYS
from ...index.walk import marks, pick_layer, select_layer
from ..kernels import choose_layer
from .base import HeadIndexes, register
from .tokens import TokenPages, group_weights, top_tokens


@dataclass(frozen=True)
class DCISettings:
    """IceCache's search (profile keys of the same names; the defaults are the shipped values,
    their figures in docs/results.md, "The index")."""

    # DCI-tree nodes expanded per level in a decode step's query (0: auto, :func:`decode_beam`);
    # at least index_beam_frac of the indexed keys (0: a fixed beam, a step's cost flat with the
    # context)
    index_beam: int = 0
    index_beam_frac: float = 0.0
    # how a node's children are cut into pages: "similar" (balanced k-means groups) or
    # "projection" (runs along a random direction)
    index_pages: str = "similar"
    # how a GQA group shares its KV head's pages: "ranks", "mass" or "peaks" (IndexConfig)
    index_merge: str = "ranks"
    # Lloyd passes over the bottom level's grouping after a build and every 256 keys (0: none)
    index_refine: int = 0
    # the keys a decode step's walk scores: "int8" (a rounded copy beside the float keys, a
    # quarter of their bytes) or "float32" (IndexConfig.walk_keys)
    index_walk_keys: str = "int8"
    # a step's walk scans the levels above the bottom whole while they hold at most this many
    # keys, from one contiguous copy, and walks level by level below them (0: every level walked;
    # IndexConfig.top_rows)
    index_top_rows: int = 2048
    # a decode step also ranks the previous search's best carry_pages pages (0: off): a narrow
    # beam keeps what an earlier, wider search found while the queries still want it
    carry_pages: int = 32
    # the tree pages a step does not load attend as one row each (their mean key and value,
    # weighted by their member count; under remapped positions only on a model with sliding-window
    # layers, :mod:`..rest`)
    rest_estimate: bool = True
    # sparse prefill: nodes per level a chunk's search expands (0: index_beam)
    prefill_beam: int = 128
    # a step loads the budget's tokens with the most of the group's estimated attention among
    # every key its walk scored (false: the walk's best whole tree pages)
    index_pick: bool = False

    def __post_init__(self):
        if self.index_beam < 0:
            raise ValueError("index_beam must be 0 (auto) or more")
        if not 0 <= self.index_beam_frac < 1:
            raise ValueError("index_beam_frac must be in [0, 1)")
        if self.index_pages not in ("projection", "similar"):
            raise ValueError("index_pages must be 'projection' or 'similar'")
        if self.index_merge not in MERGES:
            raise ValueError(f"index_merge must be one of {', '.join(MERGES)}")
        if self.index_walk_keys not in WALK_KEYS:
            raise ValueError(f"index_walk_keys must be one of {', '.join(WALK_KEYS)}")
        if self.index_top_rows < 0:
            raise ValueError("index_top_rows must be 0 (off) or more")
        if not 0 <= self.index_refine <= 10:
            raise ValueError("index_refine must be a whole number from 0 to 10")
        if not 0 <= self.carry_pages <= 1024:
            raise ValueError("carry_pages must be a whole number from 0 (off) to 1024")
        if self.prefill_beam < 0:
            raise ValueError("prefill_beam must be 0 (the index_beam) or more")


# ``index_beam: 0`` (auto): 32 nodes per level where a decode step walks the keys of 28 sparse
# layers x 3 KV heads x 64 dimensions (the embedded model, on which the beam, carry_pages and
# prefill_beam were measured together: docs/profiles.md, "The fixed beam"), and proportionally
# more where a step walks fewer key dimensions, so that its walks read about as many key bytes
# per token. Gemma 3 270M walks 3 global layers x 1 KV head x 256 dimensions: 224 nodes, 2.2 ms
# more index query a token at 16k, where 32 missed a number's digit that the exact search
# finds (docs/results.md, "Gemma 3 270M at 16k").
AUTO_BEAM = 32
AUTO_WALK_DIMS = 28 * 3 * 64


def decode_beam(settings: DCISettings, walk_dims: int = 0) -> int:
    """A decode step's beam: ``index_beam`` where set, else the auto beam for a model whose step
    walks ``walk_dims`` key dimensions (sparse layers x KV heads x head_dim; 0: unknown, the
    reference's 32)."""
    if settings.index_beam:
        return settings.index_beam
    if walk_dims <= 0:
        return AUTO_BEAM
    return max(AUTO_BEAM, AUTO_BEAM * AUTO_WALK_DIMS // walk_dims)


def spec_tree_config(spec) -> IndexConfig:
    """The trees' :class:`IndexConfig` for a cache of ``spec`` (:class:`~..spec.IceSpec`)."""
    tuning = spec.tuning if isinstance(spec.tuning, DCISettings) else DCISettings()
    return tree_config(tuning, spec.page_size, spec.chunk_tokens, decode_beam(tuning, spec.walk_dims))


@functools.lru_cache(maxsize=64)
def tree_config(settings: DCISettings, page_size: int, chunk_tokens: int, beam: int) -> IndexConfig:
    """The trees' :class:`IndexConfig` (one object for every layer of a cache with these
    arguments, which the saved state refers to by name); ``beam``: the decode beam."""
    # About two pages of children per bottom-level parent (1 in 32 promoted at pages of 16); at
    # most a chunk's keys between refinements (tiny test chunks too)
    return IndexConfig(page_size=page_size, ratio_bottom=1 / (2 * page_size), beam=beam,
                       beam_frac=settings.index_beam_frac, pages=settings.index_pages,
                       merge=settings.index_merge, refine=settings.index_refine,
                       refine_min=max(1, min(256, chunk_tokens)), walk_keys=settings.index_walk_keys,
                       top_rows=settings.index_top_rows)


@register("dci")
class DCISelector(HeadIndexes):
    Settings = DCISettings

    def __init__(self, spec):
        super().__init__(spec)
        self.tree = spec_tree_config(spec)
        self.carried: list[np.ndarray] | None = None  # carry_pages: the last choice's pages per KV head
        self.picks: list[TokenPages] = []  # index_pick: the picked tokens of each KV head, as pool pages
        self.pick_base = 0  # index_pick: above every version its pages ever had (new pages start here)

    def build(self, prompt_keys, lo: int, hi: int, capacity: int, middle=None) -> None:
        super().build(prompt_keys, lo, hi, capacity, middle)
        self.carried = None  # a new index: nothing to carry
        self.new_picks([])

    def new_index(self, head: int, capacity: int) -> DCITree:
        return DCITree(self.head_dim, self.tree, capacity=capacity)

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        return self.choose(queries, max_pages, wide, max(max_pages, self.settings.carry_pages), self.carried)

    def select_prefill(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        """A sparse prefill's choice (a chunk, or one of the prompt's last steps): the tree's
        pages, with ``prefill_beam`` (nodes per level, when set) widening the search to at least
        that beam."""
        n = max((tree.n for tree in self.indexes), default=0)
        if self.settings.prefill_beam and n:  # nodes per level, as a share of the keys
            wide = max(wide, self.settings.prefill_beam / n)
        return self.choose(queries, max_pages, wide, max_pages)

    def choose(self, queries: np.ndarray, max_pages: int, wide: float, ranked_pages: int,
               extra: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The pages a step loads: the first ``max_pages`` of each KV head's ranked tree pages
        (``ranked_pages`` of them ranked, :meth:`carry` keeps them); with ``index_pick``, pages of
        :attr:`picks` holding the ``max_pages`` x page_size tokens with the most of the group's
        estimated attention among every key the walk scored (``DCITree.pick_group``), packed
        into the pool's pages by one numba call (:func:`~..kernels.choose_layer`)."""
        if not self.settings.index_pick:
            ranked = self.select_pages(queries, ranked_pages, wide, extra)
            self.carry(ranked, max_pages)
            return [p[:max_pages] for p in ranked]
        ranked, tokens = pick_layer(self.indexes, queries, max_pages * self.spec.page_size, ranked_pages, wide,
                                    extra)
        self.carry(ranked, max_pages)
        if not self.picks or self.picks[0].npages != max_pages:
            # the pool's pages change size (a sparse prefill's chunks, its prompt end, the decode
            # budget)
            self.new_picks([TokenPages(self.spec.page_size, max_pages) for _ in self.indexes])
        H = len(self.indexes)
        n = np.array([len(t) for t in tokens], np.int64)
        chosen = np.zeros((H, max(1, int(n.max(initial=0)))), np.int32)
        for h, t in enumerate(tokens):
            chosen[h, : n[h]] = t
        out = np.empty((H, max_pages), np.int32)
        n_out = np.zeros(H, np.int64)
        picks = self.picks
        # the walk's own node marks per head (each head's tokens and held rows are its tree's points)
        choose_layer(tuple(t.members for t in picks), tuple(t.count for t in picks),
                     tuple(t.version for t in picks), tuple(marks(tree.n, h) for h, tree in enumerate(self.indexes)),
                     chosen, n, out, n_out)
        return [out[h, : n_out[h]] for h in range(H)]

    def choose_reference(self, queries: np.ndarray, max_pages: int, wide: float = 0.0,
                         extra: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """:meth:`choose` with ``index_pick``, a KV head at a time from the same state (picks of
        ``max_pages`` already made): the points each tree's walk scans (``DCITree.scanned``),
        the NumPy :func:`pick_tokens` among them, then ``TokenPages.choose_reference``; the tests
        hold the one call to it."""
        take = max_pages * self.spec.page_size
        extra = extra if extra is not None else [None] * len(self.indexes)
        return [tokens.choose_reference(pick_tokens(tree, queries[h], tree.scanned(queries[h], wide, extra[h]), take))
                for h, (tree, tokens) in enumerate(zip(self.indexes, self.picks, strict=True))]

    def new_picks(self, picks: list[TokenPages]) -> None:
        """Replace :attr:`picks` (an empty list: none until the next step), the new pages at
        versions none of the old ones ever had, so that no pool slot can take one of them for a
        page it holds."""
        self.pick_base = max([self.pick_base] + [int(t.version.max()) + 1 for t in self.picks])
        for t in picks:
            t.version[:] = self.pick_base
        self.picks = picks

    def page_table(self, head: int):
        if self.settings.index_pick:
            return self.picks[head].table()
        return super().page_table(head)

    @property
    def whole_tree_pages(self) -> bool:
        """The pool holds whole tree pages (not ``index_pick``'s tokens)."""
        return not self.settings.index_pick

    def select_pages(self, queries: np.ndarray, max_pages: int, wide: float = 0.0,
                     extra: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The tree's own pages: per KV head at most ``max_pages``, GQA-merged; ``extra[h]``:
        pages ranked with those head h's walk reaches (``carry_pages``). The heads are walked in
        parallel by one numba call; its reference is each tree's own
        :meth:`~...index.DCITree.select_group` (tests/test_index.py)."""
        return select_layer(self.indexes, queries, max_pages * self.spec.page_size, max_pages, wide, extra)

    def carry(self, pages: list[np.ndarray], max_pages: int) -> None:
        """Remember the head of ``pages`` (a search's ranked tree pages per KV head) for the next
        search: ``carry_pages`` of them, at least the ``max_pages`` the step selects (with
        ``index_pick``, the ranked pages too, not those of the picked tokens: each carried page
        is scored again by the next walk, and its members can be picked there)."""
        if self.settings.carry_pages > 0:
            keep = max(self.settings.carry_pages, max_pages)
            self.carried = [p[:keep] for p in pages]

    @property
    def rest_estimate(self) -> bool:
        return self.settings.rest_estimate

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
        self.new_picks([])


def pick_tokens(tree: DCITree, queries: np.ndarray, rows: np.ndarray, take: int) -> np.ndarray:
    """NumPy reference of ``DCITree.pick_group``'s tokens among the points ``rows`` its walk
    scanned (in scan order): the ``take`` with the most of the group's attention, each query's
    softmax over the rows' keys as the walk reads them (``DCITree.walk_keys``: the int8 copy
    times its steps, or the float keys), summed over the group, in float64, in scan order (the
    tests allow the two to differ only where weights lie within float32 rounding of the cut)."""
    rows = np.asarray(rows, np.int64)
    if len(rows) <= take:
        return rows
    return rows[top_tokens(group_weights(queries, tree.walk_rows(rows), tree.d ** -0.5), take)]
