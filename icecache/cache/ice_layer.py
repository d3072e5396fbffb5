"""One sparse layer of the ice cache (paper Algorithm 1, sections 4.1-4.5).

Life of an :class:`IceLayer`:

1. **Prompt.** Prefill chunks are kept densely (``keys``/``values``) and attended to in full.
2. **Offload** (:meth:`IceLayer.offload_prompt`, at the first decode step, the second chunk of a
   sparse prefill, or in the background as soon as the prompt's last chunk has passed the layer):
   the first ``sink`` tokens and the last ``window`` tokens stay resident
   (:class:`~.resident.ResidentKV`), the tokens between go to the host store
   (:class:`~.host_store.HostStore`) and into the page selector's index.
3. **Decode steps.** Each new token joins the window; a full window sends its oldest page run to
   the host store and the index (:meth:`IceLayer.shed_window`). The attention of a step is
   :meth:`IceLayer.attend`: select pages -> load the missing ones into pool slots -> attend over
   sink + pool + window, each stage timed into :class:`~.spec.StepStats`.

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
from .paged import (
    chunk_positions,
    paged_chunk_flash,
    paged_chunk_sdpa,
    paged_decode_rest,
    paged_decode_sdpa,
    paged_decode_weighted,
)
from .positions import Remap, ordered_offsets, place_keys, scaled_offsets, spread_offsets
from .resident import ResidentKV
from .rest import RestPages
from .selectors import PageSelector, make_selector
from .selectors.tokens import TokenPages
from .spans import SpanVotes, head_weights
from .spec import SPAN_PAGES, VOTE_STEPS, IceSpec, StepStats
from .worker import WORKER


class IceLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, layer_idx: int, spec: IceSpec, backend: TorchBackend, stats: StepStats,
                 anchor: IceLayer | None = None, remap: Remap | None = None,
                 votes: SpanVotes | None = None):
        super().__init__()
        self.votes = votes  # answer_spans: the answer start's votes, shared by the sparse layers
        self.pinned: TokenPages | None = None  # answer_spans: the pinned passages' pages
        # ... what every step's load and placement read of them, fixed once they are chosen:
        # (page ids, page table, host rows sorted), and how many rows continue the sink
        self._pinned_load: tuple | None = None
        self._pinned_lead = 0
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
        return self.resident.window()  # (not read by the ice attention)

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
        if self.selector is not None and not self.offloaded:
            if positions is None:
                positions = np.arange(self.length - queries.shape[1], self.length)
            self.selector.observe(queries, positions)

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
        self.resident.track_rows = (self.remap is not None or self.estimates or self.votes is not None
                                    or self.spec.rest_estimate)
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
        return self.remap.frame.rotate(keys, torch.arange(first, first + keys.shape[1]), 0)

    @property
    def estimates(self) -> bool:
        """Whether the selector weighs the rows it chose (``row_bias``: MagicPIG's sampling)."""
        return self.selector is not None and getattr(self.selector, "estimates", False)

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
        self.pinned = self._pinned_load = None

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

    # -- the decode step: select -> load -> attend --------------------------------------------------
    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of this step's queries (query heads, C, d) over sink + selected pages +
        window -> (1, C, query heads, d). C = 1 at a decode step; a sparse-prefill chunk has a
        few of its positions choose the pages for all of it."""
        Hq, C, d = query.shape
        if C > 1:
            return self._attend_chunk(query, scale)
        H = self.heads
        q = query[:, 0].view(H, self.group(Hq), d)
        r = self.resident
        pages = self.step_pages()
        # a prompt-end step searches (at least) tail_beam_frac of the keys: its pages decide
        # the first answer token (docs/results.md, session 11: a 64k passkey the beam missed)
        tail = self.in_tail()
        wide = self.spec.tail_beam_frac if tail or self.answering() else 0.0
        chooser = query[:, 0]
        if self.remap is not None:  # pages sit just beyond the window; their query selects (the index is position-free)
            page_distance = r.window_fill  # the window holds this step's token too
            chooser = self.remap.frame.rotate(chooser, self.length - 1, page_distance)
        self.select(chooser, pages, wide, prefill=tail)
        if self.votes is not None:
            self.answer_spans(chooser.view(H, self.group(Hq), d), scale)
        self.load()
        t0 = time.perf_counter()
        rest = self.rest_rows()
        k, v, valid = r.tensors()
        if self.remap is not None:
            # the pages end just beyond the window, the sink just before them: the keys are placed
            # there (one rotation) and the query stays at its true position
            k = self._placed(k, self.length - 1 - page_distance)
        if self.estimates and self.spec.budget_pages:
            bias = torch.from_numpy(self.selector.row_bias(r.pool_row)).to(k.device)
            out = paged_decode_weighted(q, k, v, valid, bias, r.pool_at, scale)
        elif rest is not None:
            out = paged_decode_rest(q, k, v, valid, rest, scale)
        else:
            out = paged_decode_sdpa(q, k, v, valid, scale)
        self.backend.timer_sync()
        self.stats.attention_s += time.perf_counter() - t0
        return out.reshape(1, 1, Hq, d)

    def rest_rows(self, general: bool = False):
        """``rest_estimate`` (:mod:`.rest`): this step's estimate rows (groups of keys, values,
        log-counts: one row per tree page, less the rows resident in the pool), or None where it
        does not apply (off, remapped positions, no budget, a selector without a tree, nothing
        offloaded). ``general``: with pinned passages, :meth:`RestPages.rest` from the pool's
        rows instead of :meth:`RestPages.rest_pinned` (the reference it is tested against)."""
        if (not self.spec.rest_estimate or self.remap is not None or not self.spec.budget_pages
                or self.estimates or self.store is None or not self.store.rows):
            return None
        selector = (self.anchor if self.anchor is not None else self).selector
        if not hasattr(selector, "tree_pages") or not selector.indexes:
            return None
        r = self.resident
        if self.rest is None:
            self.rest = RestPages(self.heads, self.head_dim, r.keys.device)
        if self.rest.rows != self.store.rows:  # the tree changes only when keys go into it
            self.rest.npages = 0
            for h in range(self.heads):
                members, count, version, n, _row_page = selector.tree_pages(h)
                self.rest.refresh(h, members, count, version, n, self.store)
                self.rest.npages = max(self.rest.npages, n)
            self.rest.rows = self.store.rows
        npages = self.rest.npages
        in_pool = r.valid[:, r.pool_at : r.window_at]
        if not getattr(selector, "picking", False) and not general:
            # the main slots hold whole tree pages at their current version (load planned so); a
            # slot is in use while any of its rows is (a row a pinned passage holds too is left
            # out of it); pinned passages, if any, in their own slots
            main, S = r.pool_pages - r.pinned_slots, r.page_size
            used = in_pool[:, : main * S].reshape(self.heads, main, S).any(-1)
            loaded = np.where(used, r.slot_page[:, :main], -1)
            if self._pinned_load is None:
                return self.rest.rest_whole(npages, loaded)
            return self.rest.rest_pinned(npages, loaded, self._pinned_load[2],
                                         lambda h: selector.tree_pages(h)[4], self.store)
        pool_pages = np.full(in_pool.shape, -1, np.int64)
        for h in range(self.heads):
            row_page = selector.tree_pages(h)[4]
            rows = r.pool_row[h]
            ok = in_pool[h] & (rows >= 0)
            pool_pages[h, ok] = row_page[rows[ok]]
        pool = slice(r.pool_at, r.window_at)
        return self.rest.rest(npages, pool_pages, r.keys[:, pool], r.values[:, pool])

    def step_pages(self) -> int:
        """Pages this decode step selects per KV head: a prompt token that a sparse prefill
        steps through (its tail) selects ``tail_pages`` whatever the decode budget (the pool
        still has a chunk's size then); a generated token, the decode budget."""
        if self.in_tail():
            return self.spec.tail_pages
        return self.spec.budget_pages

    def in_tail(self) -> bool:
        """This step is a prompt token a sparse prefill steps through (its tail)."""
        pool = self.resident.pool_pages - self.resident.pinned_slots
        return self.length <= self.tail_end and pool >= self.spec.tail_pages

    def answering(self) -> bool:
        """This step is one of the first ``answer_steps`` generated tokens (the prompt's
        length is known: announced, or where the first one-token step came)."""
        at = self.answer_at
        return bool(self.spec.answer_steps) and 0 < at < self.length <= at + self.spec.answer_steps

    def answer_spans(self, chooser: torch.Tensor, scale: float) -> None:
        """``answer_spans`` (:mod:`.spans`): the prompt's last steps that run one token at a time
        (at most ``VOTE_STEPS``: a sparse prefill's tail, a question after a saved document)
        vote with this step's queries, as the index sees them (H, G, d), over the offloaded
        keys. The prompt's last step pins the passages those steps voted for, so the first
        answer token already reads them. A prompt whose end came in a chunk has no votes then:
        the first generated token's step votes, and the next step pins."""
        at = self.answer_at
        if not at or self.length <= at - VOTE_STEPS or self.store is None or self.pinned is not None:
            return
        if self.length >= at and self.votes.step and self.votes.step < self.length:
            self.pinned = TokenPages(self.spec.page_size, self.spec.span_pages)
            # with remap_pin_gap the budget's pages sit far back and the passages carry the answer
            # alone: well-voted rows next to a passage join it (a needle's first mention was cut off)
            merge = self.remap is not None and bool(self.remap.pin_gap)
            ids = self.pinned.choose(self.votes.rows(self.store.rows, merge))
            rows = np.sort(self.pinned.tokens())
            self._pinned_load = (ids.astype(np.int64), self.pinned.table(), rows)
            self._pinned_lead = int(np.sum(rows == np.arange(len(rows))))  # rows 0 .. lead-1 continue the sink
        elif self.length <= at + 1:
            self.votes.add(head_weights(chooser.cpu(), self.store.keys, self.store.rows, scale), self.length)

    def group(self, query_heads: int) -> int:
        return query_heads // self.heads

    def _attend_chunk(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """A sparse-prefill chunk (query heads, C, d): a few of its positions select the pages;
        the chunk attends causally to sink + pages + window + itself. With positions remapped the
        pages sit just before the window and the sink just before them (the resident rows are
        rotated there, once for the chunk)."""
        Hq, C, d = query.shape
        r = self.resident
        at = chunk_positions(C, self.spec.prefill_queries)
        sel = query[:, torch.from_numpy(at).to(query.device)]  # (Hq, n, d)
        if self.remap is not None:
            pages_at = self.length - r.window_fill - 1  # the pages end just before the window
            true = torch.from_numpy(at) + (self.length - C)
            sel = self.remap.frame.rotate(sel, true, true - pages_at)
        self.select(sel.reshape(Hq * len(at), d), pages=self.spec.prefill_pages, prefill=True)
        self.load()
        k, v, valid = r.tensors()
        if self.remap is not None:
            k = self._placed(k, pages_at)
        attend = paged_chunk_flash if k.device.type == "cpu" else paged_chunk_sdpa  # the same attention, no mask
        out = attend(query.view(self.heads, self.group(Hq), C, d), k, v, valid, r.chunk_at, scale)
        self.after_chunk()
        return out.reshape(Hq, C, d).transpose(0, 1)[None].contiguous()

    def _placed(self, k: torch.Tensor, pages_at: int) -> torch.Tensor:
        """A copy of the resident keys with the pool rows (un-rotated) placed to end at
        ``pages_at`` (in token order, or all there) and the sink just before them."""
        r = self.resident
        valid = r.valid[:, r.pool_at : r.window_at]
        rows = r.window_at - r.pool_at
        top = pages_at - r.sink_fill  # the host row of the token at pages_at
        # positions beyond pages_at that the pool rows and the sink may take in the trained context
        room = self.remap.frame.trained - (self.length - pages_at) - r.sink_fill
        if self.remap.pages == "ordered":
            gap = self.remap.gap_for(rows)
            # rows near the window keep their true distance if the packed rest still fits
            keep = min(self.remap.keep, room + 1 - rows * gap)
            with_sink = self._with_sink() if self.pinned is not None else None  # once for both calls
            offset, count = ordered_offsets(self._placing_order(valid, with_sink), valid, gap, top, keep)
            if self.remap.pin_gap and self.pinned is not None:
                offset, count = self._behind_pinned(offset, count, valid, room, with_sink)
        elif self.remap.pages in ("scaled", "spread"):  # grouped distances that fit the trained context
            rule = scaled_offsets if self.remap.pages == "scaled" else spread_offsets
            offset, count = rule(r.pool_row, valid, top, self.remap.keep, room)
        else:  # one position for all the pages
            offset = torch.zeros(self.heads, rows, dtype=torch.int64)
            count = torch.ones(self.heads, dtype=torch.int64)
        return place_keys(self.remap.frame, k, r.sink_fill, r.pool_at, r.window_at, pages_at, offset, count)

    def _behind_pinned(self, offset: torch.Tensor, count: torch.Tensor, valid: np.ndarray,
                       room: int, with_sink: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``remap_pin_gap``: the ordered offsets (and the span, where the sink goes) with the
        sink, the selected pages' rows and the rows that stay with the sink (:meth:`_with_sink`)
        ``pin_gap`` positions farther back (less where the trained context has no room for it);
        the other pinned passages stay nearest the window. So the document's opening is not cut
        apart, and nothing comes before the sink (session 43's version kept the sink near, after
        the moved pages: the needle of a 16k passkey at depth 5% was lost; session 47). When
        the best-voted passage is the one that stays with the sink, nothing moves: that passage
        is the answer's, and it must stay near."""
        r = self.resident
        gap = min(self.remap.pin_gap, room - int(count.max()) if count.numel() else 0)
        if gap <= 0:
            return offset, count
        with_sink = self._with_sink() if with_sink is None else with_sink
        if self.votes.best < with_sink:  # the best passage continues the sink: it stays near, with the sink
            return offset, count
        cut = (r.pool_pages - r.pinned_slots) * r.page_size
        far = valid.copy()
        far[:, cut:] &= r.pool_row[:, cut:] < with_sink  # of the pinned passages, those that stay with the sink
        return offset + torch.from_numpy(np.where(far, gap, 0)), count + gap

    def _with_sink(self) -> int:
        """Pinned host rows below this stay in token order right after the sink instead of
        nearest the window: a passage that continues the sink; with ``remap_pin_gap``, a
        passage that starts within a passage's length of it too (its whole run of rows). Text
        that runs across the sink's end (a needle at the document's start) then stays together:
        cut apart, the gap took a 16k passkey at depth 0 (session 43)."""
        lead = self._pinned_lead
        if not self.remap.pin_gap or self._pinned_load is None:
            return lead
        rows = self._pinned_load[2]
        if not len(rows) or rows[0] >= SPAN_PAGES * self.resident.page_size:
            return lead
        breaks = np.flatnonzero(np.diff(rows) != 1)
        end = int(rows[breaks[0]]) + 1 if len(breaks) else int(rows[-1]) + 1  # the first run's end
        return max(lead, end)

    def _placing_order(self, valid: np.ndarray, with_sink: int | None = None) -> np.ndarray:
        """The pool rows' order keys for the ordered placement: host rows (token order), except
        that pinned answer passages come after the selected rows, nearest the window, in their own
        order (a passage that stays with the sink, :meth:`_with_sink`, stays where token order
        puts it, after the sink). With ``remap_pin_gap`` the passages are ordered by their votes,
        the best nearest the window (a filler passage voted third read between the needle and the
        question: session 47)."""
        r = self.resident
        if self.pinned is None:
            return r.pool_row
        keys = r.pool_row.copy()
        cut = (r.pool_pages - r.pinned_slots) * r.page_size
        pin, ok = keys[:, cut:], valid[:, cut:]
        last = np.where(valid[:, :cut], keys[:, :cut], -1).max(axis=1, keepdims=True)
        move = ok & (pin >= (self._with_sink() if with_sink is None else with_sink))
        if self.remap.pin_gap:  # by votes: the best passage nearest the window, each in token order
            worse = self.votes.spans - self.votes.passage_rank(pin)
            pin = worse * (int(pin.max()) + 1) + pin
        keys[:, cut:] = np.where(move, np.maximum(last, 0) + 1 + pin, keys[:, cut:])
        return keys

    def select(self, q: torch.Tensor, pages: int | None = None, wide: float = 0.0, prefill: bool = False) -> None:
        """q: (heads * G, d) query heads of this step (a sparse-prefill chunk: heads * G *
        positions, grouped by KV head); sets ``selected`` (at most ``pages`` pages per KV head;
        default: the budget). ``wide``: the search covers at least this share of the keys.
        ``prefill``: for a sparse prefill (a chunk, or one of the prompt's last steps): a
        selector's ``select_prefill`` if it has one."""
        P = self.spec.budget_pages if pages is None else pages
        self.wait()
        if self.anchor is not None:
            self.anchor.wait()
            self.selected = self.anchor.selected
            return
        if P == 0 or self.spec.budget_pages == 0:
            return  # streaming: sink and window only
        t0 = time.perf_counter()
        qn = q.detach().float().cpu().numpy().reshape(self.heads, q.shape[0] // self.heads, -1)
        if prefill and hasattr(self.selector, "select_prefill"):
            self.selected = self.selector.select_prefill(qn, P, wide)
        else:
            self.selected = self.selector.select(qn, P, wide)
        self.stats.query_s += time.perf_counter() - t0

    def load(self) -> None:
        """Bring the selected pages into the pool: only those not resident (or stale)."""
        if self.spec.budget_pages == 0:
            return
        t0 = time.perf_counter()
        owner = self.anchor if self.anchor is not None else self
        loaded, moved = self.resident.load(self.selected, owner.selector.page_table, self.store,
                                           self._pinned_load)
        self.stats.bytes_moved += moved
        self.stats.pages_loaded += loaded
        self.stats.pages_selected += sum(len(w) for w in self.selected)
        self.backend.timer_sync()
        self.stats.load_s += time.perf_counter() - t0

    # -- what the cache holds ---------------------------------------------------------------------
    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's keys and values (1, heads, length, d) in token order, on the device in
        the model's dtype: sink + host store + window (a copy; the prompt itself before offload)."""
        self.wait()
        if not self.offloaded:
            return self.keys, self.values
        r, s = self.resident, self.store
        w = slice(r.window_at, r.window_at + r.window_fill)
        host_k = s.keys[:, : s.rows].to(r.keys.device, r.keys.dtype)
        if self.remap is not None:  # back from the position-free frame to true positions
            host_k = self.remap.frame.rotate(host_k, 0, torch.arange(r.sink_fill, r.sink_fill + s.rows))
        parts = []
        for res, host in ((r.keys, host_k), (r.values, s.values[:, : s.rows])):
            parts.append(torch.cat([res[:, : r.sink_fill], host.to(res.device, res.dtype), res[:, w]], dim=1)[None])
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
