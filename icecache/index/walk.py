"""Shared group walks over several trees: the per-thread scratch they scan into, and a layer's
KV heads walked in parallel by one numba call (:func:`select_layer`)."""

from __future__ import annotations

import threading
import weakref

import numpy as np

from . import kernels

# Scanned rows a group walk's scratch starts with (it grows when a walk needs more).
WALK_ROWS, WALK_ROWS_PER_BEAM = 8192, 64
_scratch = threading.local()
# raised whenever :func:`marks` or :func:`group_scratch` puts a new array in place of one it
# handed out: a layer walk's kept scratch (:class:`_Walk`) is current while this has not moved
_replaced = [0]


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
        _replaced[0] += 1
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
        _replaced[0] += 1
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
    width = 0
    for e in extra:
        if e is not None and len(e) > width:
            width = len(e)
    shape = (queries.shape[1], max_pages, take, wide)
    w = _walks.get(trees[0])
    if w is None or not w.fits(trees, shape, width):
        if not all(t.cfg.shared_walk and t.n > 0 for t in trees):
            got = [_alone(trees[h], queries[h], k, max_pages, wide, extra[h], take) for h in range(H)]
            return [g[0] for g in got], [g[1] for g in got]
        w = _walks[trees[0]] = _Walk(trees, shape, width)
    if width and k < max_pages * trees[0].cfg.page_size:
        raise ValueError("extra pages need the shared walk's page path")
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    for h, e in enumerate(extra):
        n = w.n_extra[h] = 0 if e is None else len(e)
        if n:
            w.extras[h, :n] = e
    out, lens, ok, tok_out, tok_lens = w.out
    kernels.select_heads_shared(queries, k, max_pages, *w.before, *w.scratch(trees), *w.after, take, tok_out, tok_lens,
                                w.split)
    # a head whose scratch was too short walks again alone, with room to grow
    pages = [out[h, : lens[h]].copy() if ok[h] else None for h in range(H)]
    tokens = [tok_out[h, : tok_lens[h]].copy() if take else None for h in range(H)]
    for h in range(H):
        if not ok[h]:
            pages[h], tokens[h] = _alone(trees[h], queries[h], k, max_pages, wide, extra[h], take)
    return pages, tokens


def _alone(tree, queries, k, max_pages, wide, extra, take):
    """One head's (pages, tokens) of :func:`_layer` by its own tree's walk."""
    if take:
        return tree.pick_group(queries, take, max_pages, wide, extra)
    return tree.select_group(queries, k, max_pages, wide, extra), None


class _Walk:
    """What a layer's parallel walk hands numba that lasts from one step to the next: its trees'
    arrays as tuples by head, their beams and top levels, the output and carried-page arrays.

    Put together afresh at every call, these took about 20 us of Python a layer with warm caches
    and 76 us within a decode step (28 layers: 2 ms a token at 16k, beside a walk of about
    200 us a layer); kept, a call checks that its trees are the same objects at the same
    :attr:`~.tree.DCITree.version` (raised by every change to a tree) and the call the same
    shape. The scratch (:func:`group_scratch`: this thread's, grown as needed, and its node
    marks are what the token packing reads after the walk) is kept too, while none of its arrays
    was replaced: taken afresh at every call, with the checks above and the arguments spread
    anew, the Python around the kernel was 68 us a layer within a 16k step (1.9 ms a token). The
    output arrays are reused, so a layer's walks must run one at a time (a layer selects once a
    step).
    """

    def __init__(self, trees: list, shape: tuple, width: int):
        keys = [t.walk_keys() for t in trees]  # (which may make a tree's int8 copy: first)
        H, (_, max_pages, take, wide) = len(trees), shape
        self.refs = tuple(weakref.ref(t) for t in trees)
        self.versions = tuple(t.version for t in trees)
        self.shape = shape
        tops = [w[2] for w in keys]
        self.keys = (tuple(w[0] for w in keys), tuple(w[1] for w in keys),
                     (np.array([t[0] for t in tops], np.int64), np.array([t[1] for t in tops], np.int64),
                      *(tuple(t[i] for t in tops) for i in range(2, 7))))
        self.beams = np.array([t.beam_for(wide) for t in trees], np.int64)
        self.top_levels = np.array([t.top_level for t in trees], np.int64)
        self.links = (tuple(t.first_page for t in trees), tuple(t.next_page for t in trees),
                      tuple(t.members for t in trees), tuple(t.count for t in trees),
                      tuple(t.tok_page for t in trees))
        self.owners = tuple(t.owner for t in trees)
        self.merge = trees[0].merge_args()
        self.out = (np.empty((H, max_pages), np.int32), np.zeros(H, np.int64), np.zeros(H, np.bool_),
                    np.empty((H, max(1, take)), np.int32), np.zeros(H, np.int64))
        self.extras = np.zeros((H, max(1, width)), np.int32)
        self.n_extra = np.zeros(H, np.int64)
        # the kernel's arguments before and after the scratch, as it takes them
        self.before = (self.beams, *self.keys, self.top_levels, *self.links)
        self.after = (*self.out[:3], self.extras, self.n_extra, self.owners, *self.merge)
        self.split = kernels.split_heads(H)
        # scanned rows each head's scratch holds: room for its beam and as many carried pages
        # as the extras hold (so that no call's count of them can ask for more)
        g = shape[0]
        self.rows = [walk_rows(t.n, int(b) + self.extras.shape[1], g) for t, b in zip(trees, self.beams, strict=True)]
        self._scratch, self._scratch_at = (), None

    def scratch(self, trees: list) -> tuple:
        """This thread's scratch for the heads' walks (:func:`group_scratch`), as the kernel takes
        it (mark, ids, pages, scores: each a tuple by head); kept while no array of it was
        replaced and the thread is the same."""
        if self._scratch_at != (threading.get_ident(), _replaced[0]):
            g = self.shape[0]
            got = [group_scratch(t.n, g, self.rows[h], slot=h) for h, t in enumerate(trees)]
            self._scratch = tuple(zip(*got, strict=True))
            self._scratch_at = (threading.get_ident(), _replaced[0])
        return self._scratch

    def fits(self, trees: list, shape: tuple, width: int) -> bool:
        """Whether this walk's arrays are those of ``trees`` now, for a call of ``shape`` with up
        to ``width`` carried pages a head."""
        if shape != self.shape or width > self.extras.shape[1] or len(trees) != len(self.refs):
            return False
        for ref, tree, version in zip(self.refs, trees, self.versions, strict=True):  # (lengths equal: checked above)
            if ref() is not tree or tree.version != version:
                return False
        return True


# a layer's first tree -> its walk's kept arguments (gone with the tree)
_walks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
