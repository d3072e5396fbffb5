"""The DCI-tree of one KV head: build, insert, query (IceCache paper, section 4, Algorithms 2-4).

Keys go through the max-inner-product transform ``k -> [k, sqrt(M - |k|^2)]`` (``M`` the running
max squared norm), so that the largest inner product with a query ``q`` is the nearest point to
``[q / |q|, 0]``; all transformed keys have norm ``sqrt(M)``. Points get a level by promotion
(deterministic 1-in-N or seeded random), a parent = the nearest point one level up, and sit in a
page among their siblings: pages are runs of at most ``page_size`` children of one node,
contiguous along a random projection direction (orthogonal to the extra coordinate, so a change of
``M`` never reorders them).

Memory per indexed key (head_dim 64, float32): the 65 x 4 B transformed key is held once, in
page-major order (queries read a node's children from contiguous memory; random rows would make
a query memory-latency bound at 100k+ keys): at the 2/3 to 3/4 page fill that splits leave, and
with the page arrays' growth slack, 350-500 B; + 4 B projection + 4 B squared norm + 1 B level +
3 x 4 B parent/page/slot + 8 B node first page and size + 8 B position + ~8 B page table + query
scratch: 450-600 B, i.e. about 2x the raw key (256 B); measured figures are printed by
``icecache bench index`` (bytes/key, with the array capacity's slack). Values are not held here.
"""

from __future__ import annotations

import copy

import numpy as np

from . import kernels, walk
from .config import IndexConfig
from .kernels.pairs import MAX_DIM, pair_rows
from .place import EXACT_PARENT_PAIRS as EXACT_PARENT_PAIRS  # still importable from here
from .place import place_level
from .refine import refine_bottom

MAX_LEVELS = 12
NO_PAGES = np.empty(0, np.int32)


# Evicted pages (of page_size tokens) a tree has room for after a bulk insert, at one new page
# per key (the most a point-by-point insert can make); see DCITree._reserve_for_steps.
STEP_RESERVE = 4


class DCITree:
    """Index over the keys of one KV head. Point ids are 0..n-1 in insertion order."""

    def __init__(self, head_dim: int, config: IndexConfig | None = None, capacity: int = 1024):
        self.cfg = config or IndexConfig()
        self.d = head_dim
        self.D = head_dim + 1
        self._similar = self.cfg.pages == "similar"
        self.n = 0
        self.npages = 0
        self.top_level = -1
        self.M = 0.0
        self._rng = np.random.default_rng(self.cfg.seed)
        self._by_level: dict[int, list[np.ndarray]] = {}
        self._free = np.empty(0, np.int32)  # retired pages a refinement may fill again
        self._touched: list[np.ndarray] = []  # parents given bottom points since the last refinement
        self._pending = 0  # keys inserted since then
        u = np.random.default_rng(self.cfg.seed + 7919).standard_normal(self.D)
        u[-1] = 0.0
        self.u = (u / np.linalg.norm(u)).astype(np.float32)
        self._alloc(max(16, capacity))
        # Pages for ~80% fill (bulk builds fill pages; later inserts split them; the page arrays
        # then grow by a quarter). A page's transformed keys are most of the index's memory.
        self._alloc_pages(max(16, capacity * 5 // (4 * self.cfg.page_size)))

    # the walks' int8 copy (walk_keys: int8) where a saved tree has none: none (_walk_copy makes it)
    K8 = np.zeros((0, 1, 1, 2), np.int8)
    K8_steps = np.zeros((0, 1), np.float32)
    # the shared walks' copy of the levels they scan whole (IndexConfig.top_rows), as
    # (top_version when made, the copy); top_version is raised by every change that can touch
    # them: an insert of points above the bottom, a refinement, the int8 copy made again
    _top = None
    top_version = 0

    # -- copies -----------------------------------------------------------------------------
    _shared = False  # arrays shared with a copy (:meth:`__deepcopy__`): copied before any write
    # Raised by every change (an insert, a refinement, a copy of shared arrays, the int8 copy
    # made): a layer's walk keeps this tree's arrays between steps while it stays the same
    # (:mod:`.walk`)
    version = 0

    def __deepcopy__(self, memo) -> DCITree:
        """A copy that shares this tree's arrays until either side inserts or refines.

        A forked cache (:meth:`IceCache.forked`) holds a tree per KV head and layer, mostly
        the page-major keys: copied at once, a 128k prompt's fork doubled the process's memory.
        Queries never write the tree (their scratch is per copy), and every write goes through
        :meth:`insert` or :meth:`refine`, which first take their own copy (:meth:`_own`).
        """
        twin = copy.copy(self)
        memo[id(self)] = twin
        twin._sid, twin._ssc = np.empty_like(self._sid), np.empty_like(self._ssc)
        self._shared = twin._shared = True
        return twin

    def _own(self) -> None:
        """Before a write: this tree's own copy of whatever it still shares (the version raised:
        every write starts here)."""
        self.version += 1
        if self._shared:
            state = {k: v for k, v in vars(self).items() if k != "_shared"}
            self.__dict__.update(copy.deepcopy(state))
            self._shared = False

    # -- storage ----------------------------------------------------------------------------
    POINT_ARRAYS = ("sqnorm", "proj", "level", "parent", "pos", "tok_page", "tok_slot",
                    "first_page", "node_size")
    PAGE_ARRAYS = ("members", "PX", "count", "next_page", "owner", "lo", "hi", "dirty", "K8", "K8_steps")

    def _alloc(self, cap: int) -> None:
        """Point arrays for ``cap`` points; page arrays start small and grow with the pages."""
        self.sqnorm = np.zeros(cap, np.float32)
        self.proj = np.zeros(cap, np.float32)
        self.level = np.zeros(cap, np.int8)
        self.parent = np.full(cap, -1, np.int32)
        self.pos = np.zeros(cap, np.int64)
        self.tok_page = np.full(cap, -1, np.int32)
        self.tok_slot = np.full(cap, -1, np.int32)
        self.first_page = np.full(cap + 1, -1, np.int32)
        self.node_size = np.zeros(cap + 1, np.int32)
        self._sid = np.empty(cap, np.int32)  # query scratch, reused
        self._ssc = np.empty(cap, np.float32)
        self.cap = cap

    def _alloc_pages(self, pcap: int) -> None:
        S = self.cfg.page_size
        self.members = np.full((pcap, S), -1, np.int32)
        # Page-major copy of the transformed keys: a node's children are scored from contiguous
        # memory (random rows would make a query memory-latency bound at large n). The only copy.
        self.PX = np.zeros((pcap, S, self.D), np.float32)
        self.count = np.zeros(pcap, np.int32)
        self.next_page = np.full(pcap, -1, np.int32)
        self.owner = np.full(pcap, -1, np.int32)
        self.lo = np.zeros(pcap, np.float32)
        self.hi = np.zeros(pcap, np.float32)
        self.dirty = np.zeros(pcap, np.bool_)
        # ``walk_keys: int8``: the keys again, rounded to int8 with a step a key and laid out by
        # pairs of coordinates, for the walks to read (quantize_pages); no rows where the walks
        # read PX
        rows = pcap if self._int8_walk() else 0
        self.K8 = np.zeros((rows, *self._pair_shape()), np.int8)
        self.K8_steps = np.zeros((rows, S), np.float32)
        self.pcap = pcap

    def _grow(self, need: int, exact: bool = False) -> None:
        """Room for ``need`` points: by a quarter (long documents, little slack), or ``exact``."""
        if need <= self.cap:
            return
        cap = need if exact else max(need, self.cap + self.cap // 4)
        old = {name: getattr(self, name) for name in self.POINT_ARRAYS}
        self._alloc(cap)
        for name, arr in old.items():
            getattr(self, name)[: arr.shape[0]] = arr

    def _ensure_pages(self, extra: int, exact: bool = False) -> None:
        """Room for ``extra`` more pages (page arrays grow by a quarter, not with the points, or
        to exactly that: the quarter is 2.5 GB over a 128k prompt's trees)."""
        need = self.npages + extra
        if need <= self.pcap:
            return
        pcap = need if exact else max(need, self.pcap + self.pcap // 4, 16)
        self._walk_copy()
        old = {name: getattr(self, name) for name in self.PAGE_ARRAYS}
        self._alloc_pages(pcap)
        for name, arr in old.items():
            new = getattr(self, name)
            n = min(new.shape[0], arr.shape[0])  # (an int8 copy that this tree's walks do not read: none)
            new[:n] = arr[:n]

    # -- levels -------------------------------------------------------------------------------
    def _levels(self, start: int, n: int) -> np.ndarray:
        """Levels of points ``start .. start+n-1`` (insertion counters)."""
        out = np.zeros(n, np.int8)
        if self.cfg.promotion == "deterministic":
            step0 = max(2, round(1 / self.cfg.ratio_bottom))
            step1 = max(2, round(1 / self.cfg.ratio_upper))
            for j in range(n):
                g = start + j + 1
                if g % step0:
                    continue
                lvl, g = 1, g // step0
                while g % step1 == 0 and lvl < MAX_LEVELS - 1:
                    lvl, g = lvl + 1, g // step1
                out[j] = lvl
        else:
            draws = self._rng.random((n, MAX_LEVELS - 1))
            ratios = np.array([self.cfg.ratio_bottom] + [self.cfg.ratio_upper] * (MAX_LEVELS - 2))
            promoted = draws < ratios
            # level = number of leading successful promotions
            out[:] = np.argmin(np.concatenate([promoted, np.zeros((n, 1), bool)], 1), axis=1)
        return out

    # -- transform ----------------------------------------------------------------------------
    def _set_keys(self, ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Norms and projections of new points; return their transformed keys (m, D)."""
        sq = np.einsum("ij,ij->i", keys, keys).astype(np.float32)
        self.sqnorm[ids] = sq
        new_m = float(sq.max()) if sq.size else 0.0
        if new_m > self.M:
            self.M = new_m
            # Correct every stored extra coordinate for the new maximum.
            placed = np.flatnonzero(self.tok_page[: self.n] >= 0)
            self.PX[self.tok_page[placed], self.tok_slot[placed], -1] = np.sqrt(
                np.maximum(self.M - self.sqnorm[placed], 0.0))
        rows = np.empty((len(ids), self.D), np.float32)
        rows[:, :-1] = keys
        rows[:, -1] = np.sqrt(np.maximum(self.M - sq, 0.0))
        self.proj[ids] = rows @ self.u
        return rows

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Transformed keys (len(ids), D) of placed points (read from their pages)."""
        return self.PX[self.tok_page[ids], self.tok_slot[ids]]

    # -- building -----------------------------------------------------------------------------
    # Placing a level's points (parents, pages) is in :mod:`.place`, the refinement's passes in
    # :mod:`.refine`: both read and write this tree's arrays through the helpers below.
    def insert(self, keys: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """Index a batch of keys (m, head_dim); return the pages changed (dirty) by it.

        The first call on an empty tree builds it level by level (Algorithm 2); later calls
        insert point by point with the same level and parent rules.
        """
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        if keys.ndim != 2 or keys.shape[1] != self.d:
            raise ValueError(f"keys must be (m, {self.d}), got {keys.shape}")
        self._own()
        m = keys.shape[0]
        if positions is None:
            positions = np.arange(self.n, self.n + m)
        self.dirty[:] = False
        if m == 0:
            return np.empty(0, np.int32)
        self._grow(self.n + m)
        ids = np.arange(self.n, self.n + m, dtype=np.int32)
        levels = self._levels(self.n, m)
        self.pos[ids] = positions
        self.level[ids] = levels
        self.n += m
        rows = self._set_keys(ids, keys)
        if levels.max() > 0:  # (bottom points change only bottom pages: the walks' top copy stays)
            self.top_version += 1
        for lvl in set(levels.tolist()) - {0}:
            self._by_level.setdefault(lvl, []).append(ids[levels == lvl])
        # Levels top-down: a point's parent exists before the point itself is placed.
        # A refinement in this call cuts the bottom pages it touches again: their first cut can
        # be the cheap one (runs along the projection).
        refine_now = bool(self.cfg.refine) and self._pending + m >= self.cfg.refine_min
        for lvl in sorted(set(levels.tolist()), reverse=True):
            at = levels == lvl
            place_level(self, ids[at], lvl, rows[at], cheap=refine_now and lvl == 0 and m > 64)
        if self.cfg.refine:
            # Small batches (a decode step's evicted page) wait until refine_min keys arrived.
            self._touched.append(np.unique(self.parent[ids[levels == 0]]))
            self._pending += m
            if self._pending >= self.cfg.refine_min:
                self.refine(np.unique(np.concatenate(self._touched)), self.cfg.refine)
                self._touched, self._pending = [], 0
        if m > 64:
            self._reserve_for_steps()
        dirty = np.flatnonzero(self.dirty[: self.npages]).astype(np.int32)
        self._requantize(dirty)
        return dirty

    def _reserve_for_steps(self) -> None:
        """After a bulk insert (a build, a prompt chunk): room for :data:`STEP_RESERVE` decode
        steps' evicted pages, so the arrays grow (a copy of the whole page-major keys) during
        the prompt rather than at the first generated tokens. A point-by-point insert asks for
        room for one page per point; a build that filled its page arrays to within a few pages
        grew them at the first eviction (at 8k every tree did, in the first decode steps)."""
        S = self.cfg.page_size
        self._grow(self.n + STEP_RESERVE * S, exact=True)
        self._ensure_pages(STEP_RESERVE * (S + 1), exact=True)

    def refine(self, nodes: np.ndarray | None = None, passes: int = 1) -> int:
        """Lloyd passes over the bottom level's grouping (see :class:`IndexConfig`'s ``refine``).

        The movable points are the children of ``nodes`` (node ids of level-1 points; ``None``:
        every level-1 point). Each such parent's candidates are the ``refine_candidates``
        level-1 points nearest its children's mean (itself included); each pass moves every
        movable point to the candidate of its parent whose children's mean is nearest (squared
        distance of transformed keys), then moves every mean to its children. Only those
        parents and candidates are read, so the cost follows the batch, not the tree. The
        parents whose children changed (and ``nodes``) get their pages cut again; changed pages
        are marked dirty. Returns how many points changed parent.
        """
        moved = refine_bottom(self, nodes, passes)
        self.top_version += 1
        self._requantize(np.flatnonzero(self.dirty[: self.npages]).astype(np.int32))
        return moved

    # -- the walks' int8 keys (walk_keys: int8) ---------------------------------------------------
    def _walk_copy(self) -> bool:
        """Whether the walks read the int8 copy; made whole here where it is missing (a tree
        saved by a run that did not keep one)."""
        if not self._int8_walk():
            return False
        if self.K8.shape != (self.pcap, *self._pair_shape()):  # (or laid out by rows, as it once was)
            S = self.cfg.page_size
            self.version += 1
            self.top_version += 1
            self.K8 = np.zeros((self.pcap, *self._pair_shape()), np.int8)
            self.K8_steps = np.zeros((self.pcap, S), np.float32)
            kernels.quantize_pages(np.arange(self.npages, dtype=np.int32), self.PX, self.count, self.K8,
                                   self.K8_steps)
        return True

    def _int8_walk(self) -> bool:
        """Whether the walks read an int8 copy: ``walk_keys: int8``, for keys up to
        :data:`~.kernels.pairs.MAX_DIM` wide (wider ones' integer sums could overflow: float)."""
        return self.cfg.walk_keys == "int8" and self.d <= MAX_DIM

    def _pair_shape(self) -> tuple[int, int, int]:
        """A page of the int8 copy: (pairs of coordinates, rows, 2), :mod:`.kernels.pairs`."""
        return (self.d + 1) // 2, pair_rows(self.cfg.page_size), 2

    def walk_rows(self, ids: np.ndarray) -> np.ndarray:
        """The keys of points ``ids`` as a shared walk reads them, (len(ids), head_dim) float64:
        the int8 copy times its steps (``walk_keys: int8``), else the float keys."""
        page, slot = self.tok_page[ids], self.tok_slot[ids]
        if not self._walk_copy():
            return self.PX[page, slot, : self.d].astype(np.float64)
        pairs = self._pair_shape()[0]
        rounded = self.K8[page, :, slot].reshape(len(page), 2 * pairs)[:, : self.d]
        return rounded.astype(np.float64) * self.K8_steps[page, slot][:, None]

    def _requantize(self, pages: np.ndarray) -> None:
        """The int8 copy of ``pages`` (changed ones) made again from their float keys."""
        if self._walk_copy() and len(pages):
            kernels.quantize_pages(pages, self.PX, self.count, self.K8, self.K8_steps)

    def walk_keys(self) -> tuple[np.ndarray, np.ndarray, tuple]:
        """(keys, steps, top) the shared walks score: the int8 copy and its steps, or the float
        transformed keys and no steps; and the copy of the levels they scan whole
        (:func:`~.kernels.shared.top_copy`, kept until :attr:`top_version` moves)."""
        keys, steps = (self.K8, self.K8_steps) if self._walk_copy() else (self.PX, self.K8_steps)
        if self._top is None or self._top[0] != self.top_version:
            self._top = (self.top_version, kernels.top_copy(
                self.top_level, self.first_page, self.next_page, self.members, self.count, keys, steps,
                self.cfg.top_rows))
        return keys, steps, self._top[1]

    def _level_ids(self, lvl: int) -> np.ndarray:
        """Point ids of one level (upper levels only; kept as the points arrive)."""
        parts = self._by_level.get(lvl)
        if parts is None:
            return np.empty(0, np.int32)
        if len(parts) > 1:
            parts[:] = [np.concatenate(parts)]
        return parts[0]

    def _page_state(self) -> tuple:
        """The arrays the page kernels (``insert_child``, ``attach_sorted``) update, in order."""
        return (self.proj, self.PX, self.members, self.count, self.next_page, self.owner,
                self.lo, self.hi, self.dirty, self.first_page, self.node_size, self.tok_page,
                self.tok_slot)

    def _scratch(self):
        return self._sid, self._ssc

    # -- queries ------------------------------------------------------------------------------
    def beam_for(self, wide: float = 0.0) -> int:
        """Nodes a query expands per level: the configured beam, or ``wide`` of the points if
        more (1: every node, an exact search)."""
        return max(self.cfg.beam, int(self.cfg.beam_frac * self.n), int(np.ceil(wide * self.n)))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` points by inner product for each query (h, head_dim): ids and scores (h, k).

        Rows are padded with -1 / -inf when fewer than ``k`` points were found.
        """
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if queries.shape[1] != self.d:
            raise ValueError(f"queries must be (h, {self.d}), got {queries.shape}")
        h = queries.shape[0]
        ids = np.full((h, k), -1, np.int32)
        scores = np.full((h, k), -np.inf, np.float32)
        if self.n == 0:
            return ids, scores
        kernels.search_many(
            queries,
            self.u,
            self.top_level,
            k,
            self.beam_for(),
            self.cfg.visit_frac,
            self.PX,
            self.level,
            self.first_page,
            self.next_page,
            self.members,
            self.count,
            self.lo,
            self.hi,
            self.node_size,
            self._sid,
            self._ssc,
            ids,
            scores,
        )
        return ids, scores

    def select_pages(self, queries: np.ndarray, k: int, max_pages: int) -> list[np.ndarray]:
        """For each query, the distinct pages holding its top-``k`` keys, best first."""
        ids, _ = self.search(queries, k)
        return [kernels.ranked_pages(row[row >= 0], self.tok_page, max_pages) for row in ids]

    def _walk(self, g: int, call, beam: int | None = None) -> object:
        """Run a shared-walk kernel ``call(mark, ids, pages, scores) -> (result, ok)`` with this
        thread's scratch, growing it until the walk fits."""
        rows = walk.walk_rows(self.n, self.beam_for() if beam is None else beam, g)
        while True:
            mark, sid, spg, ssc = walk.group_scratch(self.n, g, rows)
            out, ok = call(mark, sid, spg, ssc)
            if ok:
                return out
            rows = min(self.n, 2 * rows)

    def search_group(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`search`, the queries walking the tree together (shared page reads)."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        h = queries.shape[0]
        ids = np.full((h, k), -1, np.int32)
        scores = np.full((h, k), -np.inf, np.float32)
        if self.n == 0:
            return ids, scores
        self._walk(h, lambda mark, sid, spg, ssc: (None, kernels.search_group_shared(
            queries, k, self.beam_for(), *self.walk_keys(), self.top_level, self.first_page, self.next_page,
            self.members, self.count, mark, sid, spg, ssc, ids, scores)))
        return ids, scores

    def select_group(self, queries: np.ndarray, k: int, max_pages: int, wide: float = 0.0,
                     extra: np.ndarray | None = None) -> np.ndarray:
        """The merged page list of a GQA group (``merge_group_pages`` of ``select_pages``).

        With ``shared_walk`` (the default) the group's queries walk the tree together
        (:meth:`search_group`); else each query searches alone (:meth:`search`). ``wide``: the
        beam covers at least this share of the points (:meth:`beam_for`). ``extra``: pages
        ranked with those the walk reaches whether it reaches them or not (a previous step's
        choice; the shared walk's page path only, ``k`` >= ``max_pages`` x page size).
        """
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if self.n == 0:
            return np.empty(0, np.int32)
        beam = self.beam_for(wide)
        extra = NO_PAGES if extra is None else np.ascontiguousarray(extra, dtype=np.int32)
        if len(extra) and (not self.cfg.shared_walk or k < max_pages * self.cfg.page_size):
            raise ValueError("extra pages need the shared walk's page path")
        if self.cfg.shared_walk:
            return self._shared_group(queries, k, max_pages, beam, extra, 0)[0]
        return kernels.select_group(
            queries, k, max_pages, self.u, self.top_level, beam, self.cfg.visit_frac,
            self.PX, self.level, self.first_page, self.next_page, self.members, self.count,
            self.lo, self.hi, self.node_size, self.tok_page, self._sid, self._ssc)

    def pick_group(self, queries: np.ndarray, take: int, max_pages: int, wide: float = 0.0,
                   extra: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A GQA group's token pick (``index_pick``): its merged pages as :meth:`select_group`
        ranks them (at most ``max_pages``, ``k`` = their tokens), and the ids of the ``take``
        points the shared walk scored (``extra`` pages included) with the most of the group's
        estimated attention: each query's softmax over the scanned points' scores (the keys the
        walk reads, :meth:`walk_keys`), summed over the group; in scan order. The reference is
        ``icecache.cache.selectors.dci.pick_tokens`` on the same scanned points."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if self.n == 0:
            return np.empty(0, np.int32), np.empty(0, np.int32)
        if not self.cfg.shared_walk:
            raise ValueError("token picks need the shared walk")
        beam = self.beam_for(wide)
        extra = NO_PAGES if extra is None else np.ascontiguousarray(extra, dtype=np.int32)
        return self._shared_group(queries, max_pages * self.cfg.page_size, max_pages, beam, extra, take)

    def _shared_group(self, queries, k, max_pages, beam, extra, take):
        """(pages, tokens) of the shared-walk kernel (:func:`~.kernels.select_group_shared`)."""
        return self._walk(queries.shape[0], lambda mark, sid, spg, ssc: _pair(kernels.select_group_shared(
            queries, k, max_pages, beam, *self.walk_keys(), self.top_level, self.first_page,
            self.next_page, self.members, self.count, self.tok_page, mark, sid,
            spg, ssc, extra, len(extra), self.owner, *self.merge_args(), take)), beam + len(extra))

    def scanned(self, queries: np.ndarray, wide: float = 0.0, extra: np.ndarray | None = None) -> np.ndarray:
        """The ids of the points a shared group walk with these arguments scores (``extra``
        pages included), in scan order: what :meth:`pick_group` chooses among (its reference)."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if self.n == 0:
            return np.empty(0, np.int32)
        extra = NO_PAGES if extra is None else np.ascontiguousarray(extra, dtype=np.int32)
        # every scanned point fits a take of n: all of them, in scan order
        return self._shared_group(queries, self.cfg.page_size, 1, self.beam_for(wide), extra, self.n)[1]

    def merge_args(self) -> tuple[int, float]:
        """(merge rule's code, softmax scale) of the group merge for the shared-walk kernels."""
        return kernels.MERGES.index(self.cfg.merge), float(self.d) ** -0.5

    # -- introspection --------------------------------------------------------------------------
    def live_pages(self) -> np.ndarray:
        return np.flatnonzero(self.owner[: self.npages] >= 0).astype(np.int32)

    def page_tokens(self, page: int) -> np.ndarray:
        """Point ids held by ``page``, in slot order."""
        return self.members[page, : self.count[page]].copy()

    def nbytes(self) -> int:
        names = self.POINT_ARRAYS + self.PAGE_ARRAYS
        top = sum(a.nbytes for a in self._top[1][2:]) if self._top is not None else 0  # the walks' top copy
        return int(sum(getattr(self, name).nbytes for name in names) + top)


def _pair(result):
    """A shared-walk kernel's (pages, tokens, ok) as :meth:`DCITree._walk` takes it."""
    pages, tokens, ok = result
    return (pages, tokens), ok
