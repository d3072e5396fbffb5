"""One sparse layer of the ice cache (paper Algorithm 1, sections 4.1-4.5): its lifecycle.

Life of an :class:`IceLayer`:

1. **Prompt.** Prefill chunks are kept densely (``keys``/``values``) and attended to in full.
2. **Offload** (:meth:`IceLayer.offload_prompt`, at the first decode step, the second chunk of a
   sparse prefill, or in the background as soon as the prompt's last chunk has passed the layer):
   the first ``sink`` tokens and the last ``window`` tokens stay resident
   (:class:`~.resident.ResidentKV`), the tokens between go to the host store
   (:class:`~.host_store.HostStore`) and into the page selector's index.
3. **Decode steps.** Each new token joins the window; a full window sends its oldest page run to
   the host store and the index (:meth:`IceLayer.shed_window`). The attention of a step is
   :meth:`~.ice_step.DecodeStep.attend` (:mod:`.ice_step`): select pages -> load the missing
   ones into pool slots -> attend over sink + pool + window.

``ice-reuse``: a follower layer has no selector of its own; it takes its anchor's selection and
page layout (the same token ids index its own host store). Offload and index insertion of a large
run go to the background worker (:mod:`.worker`) when the spec pipelines; a layer waits for its
own job before it is used again.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from .backend import TorchBackend
from .host_store import HostStore
from .ice_step import DecodeStep, attention_kind
from .positions import Remap
from .resident import ResidentKV
from .rest import RestPages
from .selectors import PageSelector, make_selector
from .spans import AnswerPassages, SpanVotes
from .spec import IceSpec, StepStats
from .worker import WORKER


class IceLayer(DecodeStep, CacheLayerMixin):
    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, layer_idx: int, spec: IceSpec, backend: TorchBackend, stats: StepStats,
                 anchor: IceLayer | None = None, remap: Remap | None = None,
                 votes: SpanVotes | None = None):
        super().__init__()
        # answer_spans: the votes (shared by the sparse layers) and this layer's pinned passages
        self.passages = AnswerPassages(votes, spec.page_size, spec.span_pages) if votes is not None else None
        self.remap = remap  # positions remapped (positions.py); None: true positions
        self.layer_idx = layer_idx
        self.spec = spec
        self.backend = backend
        self.stats = stats
        self.anchor = anchor  # ice-reuse: take this layer's selection and page layout
        self.followers: list[IceLayer] = []  # ice-reuse: the layers that take this one's
        if anchor is not None:
            anchor.followers.append(self)
        # The page selector; an ice-reuse follower uses its anchor's.
        self.selector: PageSelector | None = make_selector(spec) if anchor is None else None
        # the decode steps' attention
        self.kernel = attention_kind(self.selector if anchor is None else anchor.selector, spec, remap)
        self.offloaded = False  # the prompt went to sink / host store / window: steps are paged
        self.length = 0  # tokens seen (sink + host store + window)
        self.prompt_tokens = 0  # the prompt's length once announced (IceCache.begin_prefill)
        self.tail_end = 0  # the length after the prompt tokens a sparse prefill steps through
        self.answer_at = 0  # the prompt's length: generated tokens come after it (0: not known yet)
        self.heads = self.head_dim = 0
        self.store: HostStore | None = None
        self.resident: ResidentKV | None = None
        self.selected: list[np.ndarray] = []
        self.rest: RestPages | None = None  # rest_estimate: the tree pages' sums
        self._job = None  # (future, what) of this layer's background work

    # -- transformers' layer interface ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        hd = self.spec.host_dtype
        self.host_dtype = getattr(torch, hd) if hd else self.dtype
        self.heads, self.head_dim = key_states.shape[1], key_states.shape[3]
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise NotImplementedError("the ice cache holds one sequence (batch size 1)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.wait()
        n = key_states.shape[2]
        if not self.offloaded:
            if self.length > 0 and (n == 1 or self.spec.sparse_prefill):
                self.offload_prompt()  # the first decode step, or the second sparse-prefill chunk
            else:
                self._keep_prompt(key_states, value_states)
                return self.keys, self.values
        if n != 1:
            if self.resident.window_fill + n > self.resident.window_cap:
                raise ValueError(f"a prefill chunk of {n} tokens exceeds the chunk size the cache "
                                 f"was set up for ({self.spec.chunk_tokens})")
        elif self.resident.window_cap > self.spec.window_slack and self.length >= self.tail_end:
            self._to_decode_pool()  # the first decode step after a sparse prefill and its tail
        if n == 1:
            if not self.answer_at:  # a prompt that came whole (a shared prefill): it ends here
                self.answer_at = max(self.length, self.tail_end)
            self.shed_window(keep_room=True)
        self.resident.append(key_states[0], value_states[0])
        self.length += n
        # the ice attention reads the resident rows itself, not what update returns
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    # -- the prompt -------------------------------------------------------------------------------
    def _keep_prompt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, keys], dim=2)
        self.values = torch.cat([self.values, values], dim=2)
        self.length += keys.shape[2]
        waits = self.selector is not None and self.selector.waits_for_queries
        if (self.spec.pipeline and self.prompt_tokens and self.length >= self.prompt_tokens
                and not self.spec.sparse_prefill and not waits):
            # The prompt's last chunk has passed this layer: offload and index it while the next
            # layers compute (a selector that votes with the prompt's queries waits for them).
            self._job = (WORKER.submit(self._offload), "offload")

    def observe(self, queries: torch.Tensor, positions: np.ndarray | None = None) -> None:
        """A prefill chunk's queries (query heads, chunk, head_dim) at prompt ``positions``
        (default: the chunk's, the last ones the layer holds), for a selector that uses them."""
        if self.offloaded:
            return
        if positions is None:
            positions = np.arange(self.length - queries.shape[1], self.length)
        if self.selector is not None:
            self.selector.observe(queries, positions)
        if self.passages is not None and self.remap is None:  # (true positions: the host keys as they are)
            self.passages.keep(queries, positions)

    def awaits_prompt_votes(self) -> bool:
        """``answer_spans``: this is the first generated token's step after a prompt that came
        whole (no prompt token stepped) and the prompt's last queries are still to vote."""
        return (self.passages is not None and self.length == self.answer_at + 1
                and self.passages.awaits_prompt_votes())

    def prompt_votes(self, scale: float, softcap: float | None = None) -> None:
        """``answer_spans`` for a prompt that came whole: offloaded now (as its first decode step
        would), this layer votes with the prompt's last queries (:meth:`AnswerPassages.prompt_votes`)."""
        if self.passages is not None and self.passages.prompt_end is not None:
            self.offload_prompt()
            self.passages.prompt_votes(self.heads, self.store, scale, softcap)

    def offload_prompt(self) -> None:
        """Offload and index the prompt now (after any background job of this layer)."""
        self.wait()
        if not self.offloaded and self.length > 0:
            self._offload()
            self._drop_prompt_copy()

    def _drop_prompt_copy(self) -> None:
        self.keys = self.values = None
        self.offloaded = True

    def _offload(self) -> None:
        """Prompt KV -> resident sink + window, host store, index (runs on the worker too)."""
        spec, S = self.spec, self.spec.page_size
        T = self.length
        sink = min(spec.sink_tokens, T)
        middle = max(0, T - sink - spec.window_tokens)
        k, v = self.keys[0], self.values[0]  # (heads, T, d)
        window_cap = spec.window_slack + (spec.chunk_tokens if spec.sparse_prefill else 0)
        self.resident = ResidentKV(self.backend, self.heads, self.head_dim, self.dtype,
                                   spec.sink_tokens, S, spec.pool_pages, window_cap, spec.span_pages)
        # host rows of the pool: remapped pages are placed in token order; an estimating
        # selector weighs each row; a pinned passage's rows are not attended twice
        self.resident.track_rows = (self.remap is not None or self.estimates or self.passages is not None
                                    or self.kernel == "rest")
        self.resident.set_sink(k[:, :sink], v[:, :sink])
        self.resident.append(k[:, sink + middle :], v[:, sink + middle :])
        self.resident.chunk_at = self.resident.chunk_len = 0
        capacity = middle + max(256, middle // 8)  # room for decode evictions
        if spec.sparse_prefill and self.prompt_tokens > T:
            # A sparse prefill announced its prompt: the store is sized for it once (growing by
            # copies would hold two stores at a time).
            capacity = max(capacity, self.prompt_tokens - sink + 256)
        self.store = HostStore(self.backend, self.heads, self.head_dim, self.host_dtype, capacity)
        mid_k = self._position_free(k[:, sink : sink + middle], sink)
        self.store.append(mid_k.to("cpu"), v[:, sink : sink + middle].to("cpu"))
        self.selected = [np.empty(0, np.int32) for _ in range(self.heads)]
        if self.indexed:
            t0 = time.perf_counter()
            points = max(16, middle + 4 * S, capacity if spec.sparse_prefill else 0)
            self.selector.build(k, sink, sink + middle, points, None if self.remap is None else mid_k)
            self.stats.index_build_s += time.perf_counter() - t0

    def _position_free(self, keys: torch.Tensor, first: int) -> torch.Tensor:
        """Keys (heads, m, d) of tokens ``first ..`` as the host store holds them: un-rotated
        when positions are remapped, else as they are."""
        if self.remap is None or not keys.shape[1]:  # none: a prompt within sink + window
            return keys
        return self.remap.frame.rotate_run(keys, first, 0)

    @property
    def estimates(self) -> bool:
        """Whether the selector weighs the rows it chose (``row_bias``: MagicPIG's sampling)."""
        return self.selector is not None and self.selector.estimates

    @property
    def indexed(self) -> bool:
        """Whether this layer keeps an index (not an ice-reuse follower, not streaming)."""
        return self.selector is not None and self.selector.indexed and self.spec.pool_pages > 0

    # -- the window and the host store ------------------------------------------------------------
    def shed_window(self, keep_room: bool = False) -> None:
        """The window's full pages older than its last ``window_tokens`` go to the host store and
        the index. ``keep_room`` (a decode step): only once the window is a page over, so that
        the new token fits."""
        S, keep = self.spec.page_size, self.spec.window_tokens
        fill = self.resident.window_fill
        if (fill >= keep + S) if keep_room else (fill - keep >= S):
            self._evict((fill - keep) // S * S)

    def _evict(self, m: int) -> None:
        """The window's oldest ``m`` tokens to the host store and the index (in the background
        when pipelining a run longer than a page; the next step on this layer waits for it)."""
        self.wait()
        first = self.resident.sink_fill + self.store.rows  # the oldest row's position
        old_k, old_v = self.resident.pop_oldest(m)
        old_k = self._position_free(old_k, first)
        if self.spec.pipeline and m > self.spec.page_size:
            self._job = (WORKER.submit(self._store, old_k, old_v), "evict")
        else:
            self._store(old_k, old_v)

    def _store(self, old_k: torch.Tensor, old_v: torch.Tensor) -> None:
        self.store.append(old_k, old_v)
        if self.indexed:
            t0 = time.perf_counter()
            self.selector.insert(old_k)
            self.stats.index_insert_s += time.perf_counter() - t0

    def after_chunk(self) -> None:
        """After a sparse-prefill chunk's attention: shed the window's old pages (an ice-reuse
        anchor waits until its last follower attended: its pages must not change before)."""
        if self.followers:
            return
        self.shed_window()
        if self.anchor is not None and self is self.anchor.followers[-1]:
            self.anchor.shed_window()

    def _to_decode_pool(self) -> None:
        """After a sparse prefill: the resident rows shrink to the decode budget's pool and a page
        of window slack (the pool starts empty; the first step loads its pages)."""
        self.shed_window()
        self.wait()
        self.resident = self.resident.resized(self.spec.decode_pool_pages, self.spec.window_slack)

    def rebudget(self, spec) -> None:
        """Decode with ``spec`` (another budget) from here on: an empty pool of its size
        (:meth:`IceCache.forked` checks that this is exact). A sparse prefill's pool (still
        the chunk's size, for the prompt's tail) shrinks at the first generated token instead."""
        self.wait()
        self.spec = spec
        if self.selector is not None:
            self.selector.spec = spec
        if self.resident.window_cap <= spec.window_slack:
            self.resident = self.resident.resized(spec.decode_pool_pages, spec.window_slack)
        self.selected = [np.empty(0, np.int32) for _ in range(self.heads)]
        if self.passages is not None:
            self.passages.clear()

    def wait(self) -> None:
        """Finish this layer's background work (re-raising its error, if any)."""
        if self._job is None:
            return
        future, what = self._job
        self._job = None
        future.result()
        if what == "offload":
            self._drop_prompt_copy()
        WORKER.retire()

    # -- what the cache holds ---------------------------------------------------------------------
    def dense_kv(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's keys and values (1, heads, length, d) in token order, in the model's
        dtype: sink + host store + window (a copy; the prompt itself before offload), made on
        ``device`` (None: the resident pool's; with remapped positions on the pool's device,
        where the rotation's tables are, and then moved)."""
        self.wait()
        if not self.offloaded:
            return self.keys, self.values
        r, s = self.resident, self.store
        at = r.keys.device if device is None or self.remap is not None else torch.device(device)
        w = slice(r.window_at, r.window_at + r.window_fill)
        host_k = s.keys[:, : s.rows].to(at, r.keys.dtype)
        if self.remap is not None:  # back from the position-free frame to true positions
            host_k = self.remap.frame.rotate(host_k, 0, torch.arange(r.sink_fill, r.sink_fill + s.rows))
        parts = []
        for res, host in ((r.keys, host_k), (r.values, s.values[:, : s.rows])):
            rows = [res[:, : r.sink_fill].to(at), host.to(at, res.dtype), res[:, w].to(at)]
            parts.append(torch.cat(rows, dim=1)[None].to(device or at))
        return parts[0], parts[1]

    def release_index(self) -> None:
        """Drop the index after this layer's background work (the host store stays)."""
        self.wait()
        if self.selector is not None:
            self.selector.release()

    def device_bytes(self) -> int:
        if not self.offloaded:
            return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()
        return self.resident.nbytes()

    def host_bytes(self) -> int:
        return self.store.nbytes() if self.offloaded else 0
