"""The device-resident rows of one ice layer and the page pool inside them.

Per KV head the rows are laid out ``[sink | pool of P page slots | window]``:

- ``sink``: the first tokens of the sequence (``sink_cap`` rows, ``sink_fill`` used);
- ``pool``: ``P`` slots of ``page_size`` rows; slot ``s`` holds one host page (``slot_page``,
  -1 when empty), at the version it was loaded at (``slot_version``: a page whose members changed
  since must be reloaded), with ``slot_fill`` rows used;
- ``window``: the most recent tokens (``window_fill`` of ``window_cap`` rows); during a sparse
  prefill it also holds the chunk being computed (rows ``chunk_at .. chunk_at + chunk_len``).

``valid`` (heads, rows) says which rows attention may see. The buffer's size is fixed by the
spec, whatever the context length: that is the cache's device memory.
"""

from __future__ import annotations

import numpy as np
import torch

from .backend import TorchBackend
from .host_store import HostStore
from .kernels import BFLOAT16, FLOAT16, FLOAT32, load_pool, plan_head

# the host store dtypes :func:`~.kernels.load_pool` reads, as its ``kind`` codes (float32 rows
# are copied as they are, 16-bit ones widened)
WIDENING = {torch.float32: FLOAT32, torch.bfloat16: BFLOAT16, torch.float16: FLOAT16}

# ``ResidentKV.load``'s pinned pages when none are chosen: (page ids, (members, count, version),
# host rows), all empty
NO_PINNED = (np.empty(0, np.int64), (np.zeros((0, 1), np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64)),
             np.empty(0, np.int64))


def sorted_member(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``np.isin(x, table)`` for a sorted ``table`` (the pinned passages' host rows): one binary
    search per element. A decode step asks this once per layer, with a few hundred pool rows
    against about a hundred pinned ones, where ``np.isin``'s own sorting cost ~0.1 ms a call."""
    if not len(table):
        return np.zeros(x.shape, np.bool_)
    at = np.minimum(np.searchsorted(table, x), len(table) - 1)
    return table[at] == x


class ResidentKV:
    _rows_scratch: tuple[np.ndarray, np.ndarray] | None = None  # :meth:`_scratch`'s arrays, made on first use

    def __init__(self, backend: TorchBackend, heads: int, head_dim: int, dtype: torch.dtype,
                 sink_cap: int, page_size: int, pool_pages: int, window_cap: int, pinned_slots: int = 0):
        self.backend, self.heads, self.head_dim, self.dtype = backend, heads, head_dim, dtype
        self.page_size, self.pool_pages = page_size, pool_pages
        # the pool's last ``pinned_slots`` slots hold pinned pages (answer passages), the others
        # a step's selection
        self.pinned_slots = pinned_slots
        self.pool_at = sink_cap
        self.window_at = self.pool_at + pool_pages * page_size
        self.window_cap = window_cap
        self.rows = self.window_at + window_cap
        self.keys = backend.device_zeros((heads, self.rows, head_dim), dtype)
        self.values = backend.device_zeros((heads, self.rows, head_dim), dtype)
        self.valid = np.zeros((heads, self.rows), np.bool_)
        self.sink_fill = self.window_fill = 0
        self.chunk_at = self.chunk_len = 0
        self.slot_page = np.full((heads, pool_pages), -1, np.int64)
        self.slot_version = np.zeros((heads, pool_pages), np.int64)
        self.slot_fill = np.zeros((heads, pool_pages), np.int64)
        # host-store row of each pool row (-1: none): kept only when ``track_rows`` is set
        self.track_rows = False
        self.pool_row = np.full((heads, pool_pages * page_size), -1, np.int64)

    # -- sink and window -------------------------------------------------------------------------
    def set_sink(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values (heads, n, head_dim): the sequence's first ``n`` tokens."""
        n = keys.shape[1]
        self.keys[:, :n] = keys
        self.values[:, :n] = values
        self.valid[:, :n] = True
        self.sink_fill = n

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values (heads, m, head_dim) after the window's last row (a chunk is marked as
        the rows being computed)."""
        m = keys.shape[1]
        if self.window_fill + m > self.window_cap:
            raise ValueError(f"{m} new rows do not fit the window ({self.window_fill} of "
                             f"{self.window_cap} rows used)")
        at = self.window_at + self.window_fill
        rows = self.cpu_rows() if m == 1 and keys.dtype == values.dtype == torch.float32 else None
        if rows is not None:  # a decode step's row through NumPy (a torch slice assignment took ~20 us)
            rows[0][:, at] = keys.numpy()[:, 0]
            rows[1][:, at] = values.numpy()[:, 0]
        else:
            self.keys[:, at : at + m] = keys
            self.values[:, at : at + m] = values
        self.valid[:, at : at + m] = True
        self.window_fill += m
        if m > 1:
            self.chunk_at, self.chunk_len = at, m

    def pop_oldest(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove the window's oldest ``m`` rows and return them as host copies (heads, m, d)."""
        w0, f = self.window_at, self.window_fill
        old_k = self.keys[:, w0 : w0 + m].to("cpu", copy=True)  # a view on CPU otherwise
        old_v = self.values[:, w0 : w0 + m].to("cpu", copy=True)
        self.keys[:, w0 : w0 + f - m] = self.keys[:, w0 + m : w0 + f].clone()
        self.values[:, w0 : w0 + f - m] = self.values[:, w0 + m : w0 + f].clone()
        self.valid[:, w0 + f - m : w0 + f] = False
        self.window_fill -= m
        return old_k, old_v

    def resized(self, pool_pages: int, window_cap: int) -> ResidentKV:
        """A new buffer with another pool and window size holding this one's sink and window
        (the pool starts empty)."""
        out = ResidentKV(self.backend, self.heads, self.head_dim, self.dtype, self.pool_at,
                         self.page_size, pool_pages, window_cap, self.pinned_slots)
        out.track_rows = self.track_rows
        out.set_sink(self.keys[:, : self.sink_fill], self.values[:, : self.sink_fill])
        w = slice(self.window_at, self.window_at + self.window_fill)
        out.append(self.keys[:, w], self.values[:, w])
        out.chunk_at = out.chunk_len = 0
        return out

    # -- the page pool ---------------------------------------------------------------------------
    def load(self, selected: list[np.ndarray], page_table, store: HostStore,
             pinned: tuple[np.ndarray, tuple, np.ndarray] | None = None) -> tuple[int, int]:
        """Make the ``selected`` pages of every head resident, copying only those not already in
        a slot at their current version; the other slots are freed.

        ``page_table(h) -> (members, count, version)``: head ``h``'s pages (host-store row ids,
        fill, version). ``pinned``: (page ids (int64), (members, count, version), host rows) of pages
        every head keeps in the last ``pinned_slots`` slots (a selected row that is also pinned
        is left out once). Returns (pages loaded, bytes moved).

        One numba call (:func:`~.kernels.load_pool`) where it applies (:meth:`_one_call`), else
        :meth:`load_reference`, the general path it is tested against.
        """
        main = self.pool_pages - self.pinned_slots
        # a slot per wanted page (the plans fill free slots in order and assume there are enough)
        assert len(selected) == self.heads and all(len(w) <= main for w in selected), \
            f"more pages selected than the pool's {main} slots"
        assert pinned is None or len(pinned[0]) <= self.pinned_slots, "more pinned pages than pinned slots"
        kind = self._one_call(store)
        if kind is None:
            return self.load_reference(selected, page_table, store, pinned)
        pinned = NO_PINNED if pinned is None else pinned  # none chosen: the pinned slots are freed
        return self._load_one_call(selected, page_table, store, pinned, self.pool_pages - self.pinned_slots, kind)

    def load_reference(self, selected: list[np.ndarray], page_table, store: HostStore,
                       pinned: tuple[np.ndarray, tuple, np.ndarray] | None = None) -> tuple[int, int]:
        """:meth:`load` by the general path, for any device and dtype: per-head plans
        (:func:`~.kernels.plan_head`), then a torch gather and scatter of the rows."""
        S, P = self.page_size, self.pool_pages
        main = P - self.pinned_slots
        pinned = NO_PINNED if pinned is None else pinned  # none chosen: the pinned slots are freed
        want_pinned = pinned[0]
        pm, pc, pv = pinned[1]
        need = (sum(len(w) for w in selected) + self.heads * len(want_pinned)) * S
        src = np.empty(need, np.int64)
        dst = np.empty(need, np.int64)
        m = loaded = 0
        at = self.pool_at
        for h in range(self.heads):
            members, count, version = page_table(h)
            m, got = plan_head(selected[h].astype(np.int64), self.slot_page[h, :main], self.slot_version[h, :main],
                               self.slot_fill[h, :main], version, members, count, h * store.capacity,
                               h * self.rows + at, S, self.valid[h, at : at + main * S], src, dst, m)
            loaded += got
            if self.pinned_slots:
                m, got = plan_head(want_pinned, self.slot_page[h, main:], self.slot_version[h, main:],
                                   self.slot_fill[h, main:], pv, pm, pc, h * store.capacity,
                                   h * self.rows + at + main * S, S, self.valid[h, at + main * S : self.window_at],
                                   src, dst, m)
                loaded += got
        moved = 0
        if m and self.track_rows:
            rel = dst[:m] - self.pool_at
            self.pool_row[rel // self.rows, rel % self.rows] = src[:m] % store.capacity
        if len(pinned[2]):
            # a selected row that a pinned page holds too is attended once
            sel = self.valid[:, at : at + main * S]
            sel &= ~sorted_member(self.pool_row[:, : main * S], pinned[2])
        if m:
            host_k, host_v = store.flat()
            moved = self.backend.load_rows(host_k, host_v, torch.from_numpy(src[:m]),
                                           self.keys.view(-1, self.head_dim),
                                           self.values.view(-1, self.head_dim), torch.from_numpy(dst[:m]))
        return loaded, moved

    def _one_call(self, store: HostStore) -> int | None:
        """:func:`~.kernels.load_pool`'s ``kind`` for this store's elements when it can do this
        pool's loads (on the CPU, a float32 pool, a contiguous host store of float32, float16 or
        bfloat16), else None."""
        dt = store.keys.dtype
        if (self.keys.device.type != "cpu" or self.keys.dtype != torch.float32 or dt not in WIDENING
                or not (store.keys.is_contiguous() and store.values.is_contiguous())):
            return None
        return WIDENING[dt]

    def _load_one_call(self, selected, page_table, store: HostStore, pinned, main: int, kind: int):
        """:meth:`load` by one numba call (plans, widening copies, pinned rows masked)."""
        S = self.page_size
        want, lens = self._wanted(selected, main)
        members, counts, versions = zip(*[page_table(h) for h in range(self.heads)], strict=True)
        pm, pc, pv = pinned[1]
        host_k, host_v, keys, values = self._bit_views(store)
        src, dst = self._scratch(self.pool_pages * S)
        m, loaded = load_pool(
            want, lens, self.slot_page, self.slot_version, self.slot_fill, versions, members, counts, pinned[0],
            pm, pc, pv, pinned[2].astype(np.int64, copy=False), main, S, self.pool_at, self.valid, self.pool_row,
            self.track_rows, host_k, host_v, kind, keys, values, src, dst)
        return loaded, 2 * m * self.head_dim * store.keys.element_size()

    _want: tuple[np.ndarray, np.ndarray] | None = None  # :meth:`_wanted`'s arrays, kept for the next step

    def _wanted(self, selected, main: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``selected`` pages as :func:`~.kernels.load_pool` takes them: (heads, ``main``) page
        ids, each head's first ``lens[h]``, and ``lens``; the arrays are this pool's, refilled at
        every call (made anew at each, they took some 16 of the 40 us of Python a layer's load
        spent in a line profile at 16k)."""
        got = self._want
        if got is None or got[0].shape[1] < main:
            got = self._want = (np.zeros((self.heads, max(1, main)), np.int64), np.zeros(self.heads, np.int64))
        want, lens = got
        for h, w in enumerate(selected):
            n = lens[h] = len(w)
            want[h, :n] = w
        return want, lens

    _views: tuple | None = None  # :meth:`_bit_views`' arrays and the store tensors they view

    def __getstate__(self):
        """A copy (a forked cache) leaves out :meth:`_bit_views`' and :meth:`cpu_rows`' arrays:
        they view this pool's buffers, not the copy's (remade at their next use)."""
        state = self.__dict__.copy()
        state.pop("_views", None)
        state.pop("_rows", None)
        return state

    def _bit_views(self, store: HostStore) -> tuple[np.ndarray, ...]:
        """The host store's keys and values as :func:`~.kernels.load_pool` reads them (their
        bits: uint32 for float32, uint16 for 16-bit floats) and the pool's as uint32, kept until
        the store's tensors change (it grows by new ones): made each step, the views cost some
        ten torch and NumPy calls a layer."""
        got = self._views
        if got is not None and got[0] is store.keys and got[1] is store.values:
            return got[2:]
        bits = np.uint32 if store.keys.dtype == torch.float32 else np.uint16
        host = [x.numpy().view(bits) if bits is np.uint32 else x.view(torch.int16).numpy().view(bits)
                for x in (store.keys, store.values)]
        self._views = (store.keys, store.values, *host, *(x.view(np.uint32) for x in self.cpu_rows()))
        return self._views[2:]

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Two int64 arrays of at least ``n`` rows, kept for the next step."""
        got = self._rows_scratch
        if got is None or got[0].shape[0] < n:
            got = self._rows_scratch = (np.empty(n, np.int64), np.empty(n, np.int64))
        return got

    _rows: tuple | None = None  # :meth:`cpu_rows`' views, made at the first call

    def cpu_rows(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The keys and values (heads, rows, d) as float32 NumPy arrays over the same memory, or
        None off the CPU or in another dtype (made once: the buffers never change)."""
        if self._rows is None:
            cpu = self.keys.device.type == "cpu" and self.keys.dtype == self.values.dtype == torch.float32
            self._rows = (self.keys.numpy(), self.values.numpy()) if cpu else ()
        return self._rows or None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values (heads, rows, d) and the validity mask (heads, rows), on the device."""
        valid = torch.from_numpy(self.valid)
        if self.keys.device.type != "cpu":
            valid = valid.to(self.keys.device, non_blocking=True)
        return self.keys, self.values, valid

    def check(self, selected: list[np.ndarray], page_table) -> None:
        """Assert the invariants of a pool without pinned passages after :meth:`load` of
        ``selected`` (each head's pages distinct and each resident at its current version, in
        one slot; a slot's rows valid up to its fill; the sink and window within their rows).
        Tests call it after each step; a step does not (a few hundred checks per token)."""
        assert self.pinned_slots == 0, "pinned slots mask rows of the others"
        S, main = self.page_size, self.pool_pages
        assert 0 <= self.sink_fill <= self.pool_at and 0 <= self.window_fill <= self.window_cap
        assert (self.slot_fill >= 0).all() and (self.slot_fill <= S).all()
        pool_valid = self.valid[:, self.pool_at : self.window_at].reshape(self.heads, self.pool_pages, S)
        for h, want in enumerate(selected):
            assert len(set(want.tolist())) == len(want), f"head {h}: a page selected twice"
            _members, count, version = page_table(h)
            held = {}
            for s in np.flatnonzero(pool_valid[h, :main].any(axis=1)):
                p = int(self.slot_page[h, s])
                assert p >= 0 and p not in held, f"head {h}: slot {s} holds page {p} twice or none"
                held[p] = s
                assert pool_valid[h, s].sum() == self.slot_fill[h, s] == count[p]
            assert set(held) == set(want.tolist()), f"head {h}: resident pages differ from the selection"
            assert all(self.slot_version[h, held[p]] == version[p] for p in held), f"head {h}: a stale page"

    def slots_used(self) -> tuple[int, int]:
        """(pool slots holding a page, pool slots)."""
        return int((self.slot_page >= 0).sum()), self.slot_page.size

    def nbytes(self) -> int:
        return int(2 * self.keys.numel() * self.keys.element_size())
