"""The IceCache KV-cache manager inside transformers (paper Algorithm 1, sections 4.1-4.5).

:class:`IceCache` is a transformers ``Cache`` whose first ``dense_layers`` layers are ordinary
dense layers and whose other layers are :class:`IceLayer`. An ``IceLayer``:

- during prefill keeps the chunk's keys and values densely (prefill attention is full);
- at the first decode step *finalizes*: the first ``sink`` tokens and the last ``window`` tokens
  stay resident, the tokens between them move to the host store and are indexed, one
  :class:`~icecache.index.DCITree` per KV head (the ``ice-reuse`` variant: only anchor layers
  index; the layers after an anchor use its trees' page layout and its selection);
- at each decode step appends the new token to the window; once the window holds a page more
  than it keeps, its oldest page goes to the host store and into the index (pages the insertion
  changed get a new version, so a stale resident copy is reloaded);
- in the attention call (:mod:`icecache.cache.attention`) queries the index with the step's query
  heads, merges the group's page lists per KV head, loads only the pages not already resident
  into free slots of a fixed-size page pool (one gather, one copy, one scatter) and attends over
  sink + selected pages + window, masking unused slots and the empty tail of partly filled pages.

Device-resident bytes per ice layer: (sink + window + page + budget) tokens x KV heads x
head_dim x 2 (keys and values) x dtype size, whatever the context length.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..index import DCITree, IndexConfig
from ..index.tree import select_layer
from . import current
from .backend import TorchBackend
from .dense import GrowingLayer
from .kernels import plan_head

# A layer's KV heads queried by one numba call, in parallel (index.tree.select_layer).
PARALLEL_HEADS = os.environ.get("ICECACHE_PARALLEL_HEADS", "1") != "0"
_bg = None
_bg_jobs = 0  # submitted and not finished
_bg_lock = threading.Lock()
BG_PREFIX = "icecache-index"


def _submit(fn, *args):
    """Run ``fn(*args)`` on the one worker thread for offload and indexing behind the model's
    compute (the numba kernels release the GIL), in inference mode like the caller."""
    global _bg, _bg_jobs
    with _bg_lock:
        if _bg is None:
            _bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix=BG_PREFIX)
        _bg_jobs += 1
        pool = _bg

    def job():
        global _bg_jobs
        try:
            with torch.inference_mode():
                return fn(*args)
        finally:
            with _bg_lock:
                _bg_jobs -= 1

    return pool.submit(job)


def _retire_worker() -> None:
    """End the worker thread once it has nothing to do (the next job starts a new one).

    An idle worker is not free: it ran torch ops, so it is an OpenMP master with its own team,
    and with more OpenMP threads than cores libgomp stops spinning between parallel regions;
    every small op of the main thread then waits for a worker to wake. Measured here after a
    pipelined prefill of 16k tokens: the model's linear layers took 30 ms per decode step with
    the idle worker alive, 16.6 ms after it ended.
    """
    global _bg
    if threading.current_thread().name.startswith(BG_PREFIX):
        return  # never from the worker itself (it would wait for its own end)
    with _bg_lock:
        if _bg is None or _bg_jobs:
            return
        bg, _bg = _bg, None
    bg.shutdown(wait=True)


@dataclass(frozen=True)
class IceSpec:
    page_size: int = 16
    budget_pages: int = 16
    sink_tokens: int = 32
    window_tokens: int = 32
    index: IndexConfig = field(default_factory=IndexConfig)
    selector: str = "dci"  # "dci" (IceCache), "quest" (token-order pages, min/max bounds), "snapkv"
    observation: int = 32  # snapkv: prompt-end queries that vote
    pipeline: bool = True  # offload + index a layer in the background while the next computes
    sparse_prefill: bool = False  # chunks after the first attend to sink + selected pages + window
    prefill_pages: int = 64  # sparse prefill: pages a chunk selects per KV head
    chunk_tokens: int = 2048  # sparse prefill: room for one chunk in the window
    prefill_queries: int = 16  # sparse prefill: chunk positions whose queries select the pages
    dense_window: int = 4096  # sparse prefill: recent tokens the dense layers attend to
    host_dtype: str | None = None  # the host store's dtype ("float16", ...); None: the KV's own

    @property
    def pool_pages(self) -> int:
        """Pool slots during prefill (a sparse chunk's selection may be larger than decode's)."""
        if self.sparse_prefill and self.budget_pages:
            return max(self.budget_pages, self.prefill_pages)
        return self.budget_pages


@dataclass
class StepStats:
    """Summed over ice layers and decode steps (``steps`` counts model steps)."""

    steps: int = 0
    layer_steps: int = 0
    pages_selected: int = 0
    pages_loaded: int = 0
    bytes_moved: int = 0
    query_s: float = 0.0
    load_s: float = 0.0
    attention_s: float = 0.0
    index_build_s: float = 0.0
    index_insert_s: float = 0.0

    def reset_step_counters(self) -> None:
        """Forget what prefill chunks selected and loaded (a sparse prefill's work is not the
        decode steps'); the index build and insert times stay."""
        self.layer_steps = self.pages_selected = self.pages_loaded = self.bytes_moved = 0
        self.query_s = self.load_s = self.attention_s = 0.0

    def as_dict(self) -> dict:
        per = max(1, self.steps)
        return {
            "decode_steps": self.steps,
            "pages_selected_per_step": self.pages_selected / per,
            "pages_loaded_per_step": self.pages_loaded / per,
            "bytes_moved_per_step": self.bytes_moved / per,
            "query_ms_per_step": 1000 * self.query_s / per,
            "load_ms_per_step": 1000 * self.load_s / per,
            "attention_ms_per_step": 1000 * self.attention_s / per,
            "index_build_s": self.index_build_s,
            "index_insert_s": self.index_insert_s,
        }


class IceLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, layer_idx: int, spec: IceSpec, backend: TorchBackend, stats: StepStats,
                 anchor: IceLayer | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.spec = spec
        self.backend = backend
        self.stats = stats
        self.anchor = anchor  # ice-reuse: take this layer's selection and page layout
        self.followers: list[IceLayer] = []  # ice-reuse: the layers that take this one's
        if anchor is not None:
            anchor.followers.append(self)
        self.decoding = False
        self.length = 0  # tokens seen (sink + middle + window)
        self.expect = 0  # the prompt's length once announced (IceCache.begin_prefill)
        self.selected: list[np.ndarray] = []
        self._pending = None  # background work on this layer (finalize or an eviction)
        self.chunk_at = self.chunk_len = 0  # the sparse-prefill chunk's rows in the window

    # -- transformers' layer interface ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        hd = self.spec.host_dtype
        self.host_dtype = getattr(torch, hd) if hd else self.dtype
        self.H, self.d = key_states.shape[1], key_states.shape[3]
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise NotImplementedError("the ice cache holds one sequence (batch size 1)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.wait()
        q = key_states.shape[2]
        if not self.decoding:
            if self.length > 0 and (q == 1 or self.spec.sparse_prefill):
                self.finalize_now()  # the first decode step, or the second sparse-prefill chunk
            else:
                self.keys = torch.cat([self.keys, key_states], dim=2)
                self.values = torch.cat([self.values, value_states], dim=2)
                self.length += q
                if (self.spec.pipeline and self.expect and self.length >= self.expect
                        and not self.spec.sparse_prefill and self.spec.selector != "snapkv"):
                    # The prompt's last chunk has passed this layer: offload and index it while
                    # the next layers compute (snapkv needs this chunk's queries first).
                    self._pending = (_submit(self._finalize), "finalize")
                return self.keys, self.values
        if q != 1:
            self._append_chunk(key_states[0], value_states[0])
            w = slice(self.win_at, self.win_at + self.win_fill)
            return self.res_k[None, :, w], self.res_v[None, :, w]  # not used by the ice attention
        if self.win_cap > self.spec.window_tokens + self.spec.page_size:
            self.chunk_len = 0  # the first decode step after a sparse prefill
            self._to_decode_pool()
        self._append(key_states[0, :, 0], value_states[0, :, 0])
        w = slice(self.win_at, self.win_at + self.win_fill)
        return self.res_k[None, :, w], self.res_v[None, :, w]  # not used by the ice attention

    def wait(self) -> None:
        """Finish this layer's background work (re-raising its error, if any)."""
        if self._pending is None:
            return
        fut, kind = self._pending
        self._pending = None
        fut.result()
        if kind == "finalize":
            self._finalized()
        _retire_worker()

    def finalize_now(self) -> None:
        self.wait()
        if not self.decoding and self.length > 0:
            self._finalize()
            self._finalized()

    def _finalized(self) -> None:
        self.keys = self.values = None  # the dense prefill copy is gone
        self.decoding = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    # -- finalize: prefill KV -> sink, host store + index, window --------------------------------
    def _finalize(self) -> None:
        """Resident buffer per KV head: [sink | pool of P pages | window + one page]."""
        S, spec = self.spec.page_size, self.spec
        T = self.length
        sink = min(spec.sink_tokens, T)
        mid = max(0, T - sink - spec.window_tokens)
        k, v = self.keys[0], self.values[0]  # (H, T, d)
        H, d, P = self.H, self.d, spec.pool_pages
        self.sink_len = sink
        self.pool_at = spec.sink_tokens
        self.win_at = self.pool_at + P * S
        self.win_cap = spec.window_tokens + S + (spec.chunk_tokens if spec.sparse_prefill else 0)
        L = self.win_at + self.win_cap
        self.L = L
        self.res_k = self.backend.device_zeros((H, L, d), self.dtype)
        self.res_v = self.backend.device_zeros((H, L, d), self.dtype)
        self.valid = np.zeros((H, L), np.bool_)  # which resident rows attention may see
        self.res_k[:, :sink] = k[:, :sink]
        self.res_v[:, :sink] = v[:, :sink]
        self.valid[:, :sink] = True
        w = T - sink - mid
        self.res_k[:, self.win_at : self.win_at + w] = k[:, sink + mid :]
        self.res_v[:, self.win_at : self.win_at + w] = v[:, sink + mid :]
        self.win_fill = w
        self.valid[:, self.win_at : self.win_at + w] = True
        # Host store: middle tokens in token order, one block of rows per KV head.
        self.host_cap = mid + max(256, mid // 8)  # room for decode evictions; grows by a quarter
        if spec.sparse_prefill and self.expect > T:
            # A sparse prefill announced its prompt: the store is sized for it once (growing by
            # copies would hold two stores at a time).
            self.host_cap = max(self.host_cap, self.expect - sink + 256)
        self.host_k = self.backend.host_empty((H, self.host_cap, d), self.host_dtype)
        self.host_v = self.backend.host_empty((H, self.host_cap, d), self.host_dtype)
        self.host_k[:, :mid] = k[:, sink : sink + mid].to("cpu")
        self.host_v[:, :mid] = v[:, sink : sink + mid].to("cpu")
        self.mid = mid
        # Pool slots: slot -> (page, version, fill); -1 = empty.
        self.slot_page = np.full((H, P), -1, np.int64)
        self.slot_version = np.zeros((H, P), np.int64)
        self.slot_fill = np.zeros((H, P), np.int64)
        self.selected = [np.empty(0, np.int32) for _ in range(H)]
        self.indexed = self.anchor is None and P > 0  # streaming (no pages): no index
        if self.indexed:
            t0 = time.perf_counter()
            keys_np = k[:, sink : sink + mid].float().cpu().numpy()  # the keys before rounding
            if spec.selector == "snapkv":
                from .selectors import snap_votes

                obs = getattr(self, "obs_q", None)
                self._votes = (snap_votes(obs, k, sink, mid, self.d ** -0.5) if obs is not None
                               else np.zeros((H, mid)))
            self.trees = []
            self.page_version = []
            for h in range(H):
                tree = self._new_index(d, max(16, mid + 4 * S, self.host_cap if spec.sparse_prefill else 0), h)
                tree.insert(keys_np[h])
                self.trees.append(tree)
                self.page_version.append(np.zeros(max(64, tree.npages * 2), np.int64))
            self.stats.index_build_s += time.perf_counter() - t0

    def _new_index(self, d: int, capacity: int, head: int):
        if self.spec.selector == "snapkv":
            from .selectors import SnapIndex

            return SnapIndex(self.spec.page_size, self.spec.budget_pages * self.spec.page_size,
                             self._votes[head])
        if self.spec.selector == "quest":
            from .selectors import QuestIndex

            return QuestIndex(d, self.spec.page_size, capacity)
        return DCITree(d, self.spec.index, capacity=capacity)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One new token (H, d) into the window; a full window sends its oldest page away."""
        S, keep = self.spec.page_size, self.spec.window_tokens
        if self.win_fill >= keep + S:
            self._evict((self.win_fill - keep) // S * S)
        at = self.win_at + self.win_fill
        self.res_k[:, at] = k
        self.res_v[:, at] = v
        self.valid[:, at] = True
        self.win_fill += 1
        self.length += 1

    def _append_chunk(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A sparse-prefill chunk (H, C, d) into the window (the previous chunk's full pages
        older than the window went to the host store and the index after its attention)."""
        C = k.shape[1]
        if self.win_fill + C > self.win_cap:
            raise ValueError(f"a prefill chunk of {C} tokens exceeds the chunk size the cache "
                             f"was set up for ({self.spec.chunk_tokens})")
        at = self.win_at + self.win_fill
        self.res_k[:, at : at + C] = k
        self.res_v[:, at : at + C] = v
        self.valid[:, at : at + C] = True
        self.chunk_at, self.chunk_len = at, C
        self.win_fill += C
        self.length += C

    def after_chunk(self) -> None:
        """After a sparse-prefill chunk's attention: the window's full pages older than the last
        ``window_tokens`` go to the host store and the index, in the background when pipelining
        (the next layers compute meanwhile; this layer's next chunk waits for it)."""
        if self.followers:
            return  # an ice-reuse anchor: its pages change only after its followers attended
        self._evict_old()
        if self.anchor is not None and self is self.anchor.followers[-1]:
            self.anchor._evict_old()

    def _evict_old(self) -> None:
        S, keep = self.spec.page_size, self.spec.window_tokens
        if self.win_fill - keep >= S:
            self._evict((self.win_fill - keep) // S * S)

    def _to_decode_pool(self) -> None:
        """After a sparse prefill: the resident buffer shrinks to the decode budget's pool and a
        page of window slack (the pool starts empty; the first step loads its pages)."""
        S, keep, P = self.spec.page_size, self.spec.window_tokens, self.spec.budget_pages
        self._evict_old()
        self.wait()
        H, d = self.H, self.d
        win_at = self.pool_at + P * S
        L = win_at + keep + S
        res_k = self.backend.device_zeros((H, L, d), self.dtype)
        res_v = self.backend.device_zeros((H, L, d), self.dtype)
        valid = np.zeros((H, L), np.bool_)
        n, f = self.sink_len, self.win_fill
        res_k[:, :n] = self.res_k[:, :n]
        res_v[:, :n] = self.res_v[:, :n]
        valid[:, :n] = True
        res_k[:, win_at : win_at + f] = self.res_k[:, self.win_at : self.win_at + f]
        res_v[:, win_at : win_at + f] = self.res_v[:, self.win_at : self.win_at + f]
        valid[:, win_at : win_at + f] = True
        self.res_k, self.res_v, self.valid = res_k, res_v, valid
        self.win_at, self.win_cap, self.L = win_at, keep + S, L
        self.slot_page = np.full((H, P), -1, np.int64)
        self.slot_version = np.zeros((H, P), np.int64)
        self.slot_fill = np.zeros((H, P), np.int64)

    def _evict(self, m: int) -> None:
        """The window's oldest ``m`` tokens go to the host store and the index (in the background
        when pipelining; the next step on this layer waits for it)."""
        self.wait()
        w0, f = self.win_at, self.win_fill
        old_k = self.res_k[:, w0 : w0 + m].to("cpu", copy=True)  # a view on CPU otherwise
        old_v = self.res_v[:, w0 : w0 + m].to("cpu", copy=True)
        self.res_k[:, w0 : w0 + f - m] = self.res_k[:, w0 + m : w0 + f].clone()
        self.res_v[:, w0 : w0 + f - m] = self.res_v[:, w0 + m : w0 + f].clone()
        self.valid[:, w0 + f - m : w0 + f] = False
        self.win_fill -= m
        if self.spec.pipeline and m > self.spec.page_size:
            self._pending = (_submit(self._store, old_k, old_v), "evict")
        else:
            self._store(old_k, old_v)

    def _store(self, old_k: torch.Tensor, old_v: torch.Tensor) -> None:
        m = old_k.shape[1]
        if self.mid + m > self.host_cap:
            cap = self.mid + m + max(self.host_cap // 4, 4 * m)  # by a quarter: little slack
            for name in ("host_k", "host_v"):
                old = getattr(self, name)
                new = self.backend.host_empty((self.H, cap, self.d), self.host_dtype)
                new[:, : self.mid] = old[:, : self.mid]
                setattr(self, name, new)
            self.host_cap = cap
        self.host_k[:, self.mid : self.mid + m] = old_k
        self.host_v[:, self.mid : self.mid + m] = old_v
        self.mid += m
        if self.indexed:
            t0 = time.perf_counter()
            keys_np = old_k.float().numpy()
            for h, tree in enumerate(self.trees):
                dirty = tree.insert(keys_np[h])
                ver = self.page_version[h]
                if tree.npages > len(ver):
                    grown = np.zeros(2 * tree.npages, np.int64)
                    grown[: len(ver)] = ver
                    self.page_version[h] = ver = grown
                ver[dirty] += 1
            self.stats.index_insert_s += time.perf_counter() - t0

    # -- the decode step ---------------------------------------------------------------------------
    def _layout(self):
        """(trees, page versions) whose pages this layer loads: its own or its anchor's."""
        src = self.anchor if self.anchor is not None else self
        return src.trees, src.page_version

    def select(self, q: torch.Tensor, pages: int | None = None) -> None:
        """q: (H * G, d) query heads of this step (a sparse-prefill chunk: H * G * positions,
        grouped by KV head); sets ``selected`` (at most ``pages`` pages per KV head)."""
        P = self.spec.budget_pages if pages is None else pages
        self.wait()
        if self.anchor is not None:
            self.anchor.wait()
            self.selected = self.anchor.selected
            return
        if P == 0 or self.spec.budget_pages == 0:
            return  # streaming: sink and window only
        t0 = time.perf_counter()
        G = q.shape[0] // self.H
        qn = q.detach().float().cpu().numpy()
        k = P * self.spec.page_size

        if PARALLEL_HEADS:
            self.selected = select_layer(self.trees, qn.reshape(self.H, G, -1), k, P)
        else:
            self.selected = [t.select_group(qn[h * G : (h + 1) * G], k, P)
                             for h, t in enumerate(self.trees)]
        self.stats.query_s += time.perf_counter() - t0

    def load(self) -> None:
        """Bring the selected pages into the pool: only those not resident (or stale)."""
        t0 = time.perf_counter()
        S = self.spec.page_size
        if self.spec.budget_pages == 0:
            return
        trees, versions = self._layout()
        need = sum(len(w) for w in self.selected) * S
        src = np.empty(need, np.int64)
        dst = np.empty(need, np.int64)
        m = loaded = 0
        for h in range(self.H):
            tree = trees[h]
            m, got = plan_head(
                self.selected[h].astype(np.int64), self.slot_page[h], self.slot_version[h],
                self.slot_fill[h], versions[h], tree.members, tree.count, h * self.host_cap,
                h * self.L + self.pool_at, S, self.valid[h, self.pool_at : self.win_at], src, dst, m)
            loaded += got
        if m:
            self.stats.bytes_moved += self.backend.load_rows(
                self.host_k.view(-1, self.d), self.host_v.view(-1, self.d), torch.from_numpy(src[:m]),
                self.res_k.view(-1, self.d), self.res_v.view(-1, self.d), torch.from_numpy(dst[:m]))
        selected = need // S
        self.stats.pages_loaded += loaded
        self.stats.pages_selected += selected
        self.stats.load_s += time.perf_counter() - t0

    def resident_kv(self):
        """Keys, values (H, L, d) and the validity mask (H, L) of sink + pool + window."""
        valid = torch.from_numpy(self.valid)
        if self.res_k.device.type != "cpu":
            valid = valid.to(self.res_k.device, non_blocking=True)
        return self.res_k, self.res_v, valid

    def device_bytes(self) -> int:
        if not self.decoding:
            return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()
        return int(2 * self.res_k.numel() * self.res_k.element_size())

    def host_bytes(self) -> int:
        if not self.decoding:
            return 0
        return 2 * self.H * self.mid * self.d * self.host_k.element_size()


class IceCache(Cache):
    """Dense layers (:class:`~icecache.cache.dense.GrowingLayer`) below ``dense_layers``;
    :class:`IceLayer` from there on."""

    def __init__(self, num_layers: int, spec: IceSpec, dense_layers: int = 2,
                 reuse_every: int = 1, device: torch.device | str = "cpu"):
        self.spec = spec
        self.backend = TorchBackend(device)
        self.stats = StepStats()
        layers: list = []
        anchor = None
        for i in range(num_layers):
            if i < dense_layers:
                layers.append(GrowingLayer())
                continue
            if reuse_every > 1 and (i - dense_layers) % reuse_every:
                layers.append(IceLayer(i, spec, self.backend, self.stats, anchor=anchor))
            else:
                anchor = IceLayer(i, spec, self.backend, self.stats)
                layers.append(anchor)
        super().__init__(layers=layers)
        self.num_dense = dense_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        current.set_current(self)
        if layer_idx == self.num_dense and key_states.shape[2] == 1:
            self.stats.steps += 1
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def ice_layers(self) -> list[IceLayer]:
        return [layer for layer in self.layers if isinstance(layer, IceLayer)]

    def begin_prefill(self, tokens: int) -> None:
        """The next ``tokens`` prompt tokens come in chunks: a layer whose last chunk has passed
        can go to the host store and its index while the next layers compute."""
        for layer in self.ice_layers():
            layer.expect = layer.length + tokens

    def end_prefill(self) -> None:
        """Every layer offloaded and indexed (the prefill's wall time includes its index)."""
        for layer in self.ice_layers():
            layer.finalize_now()
        self.stats.reset_step_counters()

    def device_kv_bytes(self) -> int:
        dense = sum(layer.device_bytes() for layer in self.layers if isinstance(layer, GrowingLayer))
        return dense + sum(layer.device_bytes() for layer in self.ice_layers())

    def host_kv_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.ice_layers())

    def pool_occupancy(self) -> float:
        """Share of the decode page pools' slots holding a page (0 before the first step)."""
        used = total = 0
        for layer in self.ice_layers():
            slots = getattr(layer, "slot_page", None)
            if layer.decoding and slots is not None and slots.size:
                used += int((slots >= 0).sum())
                total += slots.size
        return used / total if total else 0.0
