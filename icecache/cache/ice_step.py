"""An ice layer's attention once its prompt is offloaded: select -> load -> attend.

:class:`DecodeStep` is the part of :class:`~.ice_layer.IceLayer` that runs a step (a decode
token, or a chunk of a sparse prefill); the layer's lifecycle (the prompt, offload, eviction,
background jobs) is in :mod:`.ice_layer`. A step asks the page selector for pages (``select``),
brings the missing ones into the pool (``load``, :meth:`ResidentKV.load`) and attends over sink +
pool + window with the attention chosen once for the layer (:attr:`DecodeStep.kernel`):

- ``weighted``: a selector that estimates (MagicPIG) weighs the rows it chose (``row_bias``);
- ``rest``: ``rest_estimate`` adds a row per tree page that is not loaded (:mod:`.rest`);
- ``plain``: exact attention over the resident rows (on a GPU through FlashInfer's paged decode
  where ``attention_backend`` has it: :mod:`.flashinfer_decode`).

With remapped positions the resident keys are placed just beyond the window, and beyond the
model's largest sliding window (:meth:`~.positions.Remap.pages_end`, :mod:`.placement`; on the
CPU each row turns as the kernel scores it), the estimate rows of ``rest`` together just past
them; with ``answer_spans`` the prompt's last steps
vote for the passages that stay resident for the answer (:class:`~.spans.AnswerPassages`). Each
stage is timed into :class:`~.spec.StepStats`. A model that caps its scores (``softcap``, Gemma 2)
has every one of these attentions cap them (:mod:`.paged`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .kernels import placed_decode
from .paged import (
    chunk_positions,
    paged_chunk_flash,
    paged_chunk_sdpa,
    paged_decode_placed,
    paged_decode_rest,
    paged_decode_sdpa,
    paged_decode_weighted,
)
from .placement import placed, placing, placing_args
from .positions import place_keys, table_rows
from .rest import RestPages, kernel_groups, step_rest
from .score_kernels import paged_decode_fused


def attention_kind(selector, spec, remap) -> str:
    """The attention of an ice layer's decode steps: ``weighted``, ``rest`` or ``plain``
    (see the module's docstring).

    With remapped positions the estimate rows are kept only on a model with sliding-window
    layers (``remap.page_distance``: its far pages sit beyond that window): there they are what
    finds Gemma 3's needles past its 32k; on a model without them (the embedded one) the rows,
    thousands of pages at one distance, buried its 64k passkey and 100k report answers
    (docs/results.md, "Gemma 3 270M past its trained context")."""
    if not spec.budget_pages:
        return "plain"
    if selector is not None and selector.estimates:
        return "weighted"
    if selector is not None and selector.rest_estimate and (remap is None or remap.page_distance > 0):
        return "rest"
    return "plain"


class DecodeStep:
    """select -> load -> attend for :class:`~.ice_layer.IceLayer` (its state is the layer's)."""

    _table_rows = 0  # rows of the rotation tables this layer's remapped steps needed so far

    def attend(self, query: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
        """Attention of this step's queries (query heads, C, d) over sink + selected pages +
        window -> (1, C, query heads, d). C = 1 at a decode step; a sparse-prefill chunk has a
        few of its positions choose the pages for all of it. ``softcap``: the model's cap on its
        attention scores (None: none)."""
        Hq, C, d = query.shape
        if C > 1:
            return self._attend_chunk(query, scale, softcap)
        H = self.heads
        q = query[:, 0].view(H, self.group(Hq), d)
        r = self.resident
        pages = self.step_pages()
        # a prompt-end step searches (at least) tail_beam_frac of the keys: its pages decide the
        # first answer token (a 64k passkey's needle was missed by the narrower beam)
        tail = self.in_tail()
        wide = self.spec.tail_beam_frac if tail else 0.0
        chooser = query[:, 0]
        if self.remap is not None:  # pages sit just beyond the window; their query selects (the index is position-free)
            pages_at = self.remap.pages_end(self.length, r.window_fill)
            chooser = self.remap.frame.rotate(chooser, self.length - 1, self.length - 1 - pages_at)
        self.select(chooser, pages, wide, prefill=tail)
        if self.passages is not None:
            merge = self.remap is not None and bool(self.remap.pin_gap)
            self.passages.step(self.length, self.answer_at, self.store, chooser.view(H, self.group(Hq), d),
                               scale, merge, softcap)
        self.load()
        t0 = time.perf_counter()
        one_call = self.kernel == "rest" or self.kernel == "plain" and self.remap is not None
        rows = r.cpu_rows() if one_call and q.dtype == torch.float32 else None
        if rows is not None:  # on the CPU in float32: the placement, the estimate rows and the attention in one numba call
            out = self._cpu_rows(q, rows, None if self.remap is None else pages_at, scale, softcap)
        else:
            out = self._attend_tensors(q, scale, softcap, None if self.remap is None else pages_at)
        self.backend.timer_sync()
        self.stats.attention_s += time.perf_counter() - t0
        return out.reshape(1, 1, Hq, d)

    def _cpu_rows(self, q: torch.Tensor, rows: tuple, pages_at: int | None, scale: float,
                  softcap: float | None) -> torch.Tensor:
        """:meth:`attend`'s attention over the pool's own float32 arrays ``rows`` in one numba
        call: with remapped positions (``pages_at``: where the pages end) the placement too
        (:func:`~.kernels.placed_decode`; the rotation tables grow when a step's placement needs
        more rows, and stay that long for the layer's later steps), and ``rest_estimate``'s rows
        where this layer has them (:func:`~.rest.kernel_groups`). The reference is
        :meth:`_attend_tensors`."""
        r = self.resident
        rest = self.rest_rows() if self.kernel == "rest" else None
        groups = None if rest is None else kernel_groups(self.rest, rest)
        qn = np.ascontiguousarray(q.numpy())
        out = np.empty(q.shape, np.float32)
        cap = np.float32(softcap or 0.0)
        if pages_at is None:
            paged_decode_fused(qn, *rows, r.valid, np.float32(scale), cap, out, None, qn, groups)
            return torch.from_numpy(out)
        args = placing_args(r, self.remap, self.passages, self.length, pages_at)
        frame = self.remap.frame
        turn = None if groups is None else (frame.inv_freq.numpy(), self.length - 1, int(pages_at))
        n = max(self._table_rows, r.window_at + 1)
        while True:
            cos_t, sin_t = frame.down_arrays(int(pages_at), n)
            need = placed_decode(qn, *rows, r.valid, np.float32(scale), cap, out, args, r.sink_fill, r.pool_at,
                                 cos_t, sin_t, frame.rotary_dim, groups, turn)
            if not need:
                self._table_rows = n
                return torch.from_numpy(out)
            n = table_rows(need, r.window_at)

    def _attend_tensors(self, q: torch.Tensor, scale: float, softcap: float | None,
                        pages_at: int | None) -> torch.Tensor:
        """:meth:`attend`'s attention over the resident tensors (``pages_at``: where the pages
        end with remapped positions, else None)."""
        d = q.shape[2]
        r = self.resident
        place = None
        if pages_at is not None:
            # the pages end just beyond the window, the sink just before them: the keys are placed
            # there (one rotation, made as the rows are scored where the kernel can) and the query
            # stays at its true position
            offset, count = placing(r, self.remap, self.passages, self.length, pages_at)
            place = (self.remap.frame, r.sink_fill, r.pool_at, r.window_at, pages_at, offset, count)
        k, v, valid = r.tensors()
        rest = self.rest_rows() if self.kernel == "rest" else None
        if rest is not None and place is not None:
            # remapped: the estimate rows sit together just past the farthest placed row of the
            # pool (their mean keys un-rotated: the query turns to that distance instead)
            k = place_keys(place[0], k, *place[1:])
            far = self.length - 1 - pages_at + int(count.max())
            rest_q = self.remap.frame.rotate(q.reshape(-1, d), self.length - 1, far).view(q.shape)
            out = paged_decode_rest(q, k, v, valid, rest, scale, softcap, rest_q)
        elif self.kernel == "weighted":
            if place is not None:
                k = place_keys(place[0], k, *place[1:])
            bias = torch.from_numpy(self.selector.row_bias(r.pool_row)).to(k.device)
            out = paged_decode_weighted(q, k, v, valid, bias, r.pool_at, scale, softcap)
        elif rest is not None:
            out = paged_decode_rest(q, k, v, valid, rest, scale, softcap)
        elif place is not None:
            out = paged_decode_placed(q, k, v, valid, scale, softcap, *place)
        else:  # FlashInfer's kernel where the profile and the device have it, else torch's
            out = self.backend.decode_attention(self.layer_idx, q, k, v, r.valid, scale, softcap)
            if out is None:
                out = paged_decode_sdpa(q, k, v, valid, scale, softcap)
        return out

    def rest_rows(self, general: bool = False):
        """``rest_estimate`` (:func:`~.rest.step_rest`): this step's estimate rows, or None where
        it does not apply (not this layer's attention, nothing offloaded yet, no tree yet).
        ``general``: the reference path with pinned passages."""
        if self.kernel != "rest" or self.store is None or not self.store.rows:
            return None
        selector = (self.anchor if self.anchor is not None else self).selector
        if not selector.has_tree:
            return None
        if self.rest is None:
            self.rest = RestPages(self.heads, self.head_dim, self.resident.keys.device)
        load = self.passages.load if self.passages is not None else None
        return step_rest(self.rest, selector, self.resident, self.store, None if load is None else load[2], general)

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

    def group(self, query_heads: int) -> int:
        return query_heads // self.heads

    def _attend_chunk(self, query: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
        """A sparse-prefill chunk (query heads, C, d): a few of its positions select the pages;
        the chunk attends causally to sink + pages + window + itself. With positions remapped the
        pages sit just before the window and the sink just before them (the resident rows are
        rotated there, once for the chunk)."""
        Hq, C, d = query.shape
        r = self.resident
        at = chunk_positions(C, self.spec.prefill_queries)
        sel = query[:, torch.from_numpy(at).to(query.device)]  # (Hq, n, d)
        if self.remap is not None:
            pages_at = self.remap.pages_end(self.length, r.window_fill)  # just before the window
            true = torch.from_numpy(at) + (self.length - C)
            sel = self.remap.frame.rotate(sel, true, true - pages_at)
        self.select(sel.reshape(Hq * len(at), d), pages=self.spec.prefill_pages, prefill=True)
        self.load()
        k, v, valid = r.tensors()
        if self.remap is not None:
            k = placed(k, r, self.remap, self.passages, self.length, pages_at)
        attend = paged_chunk_flash if k.device.type == "cpu" else paged_chunk_sdpa  # the same attention, no mask
        out = attend(query.view(self.heads, self.group(Hq), C, d), k, v, valid, r.chunk_at, scale, softcap)
        self.after_chunk()
        return out.reshape(Hq, C, d).transpose(0, 1)[None].contiguous()

    def select(self, q: torch.Tensor, pages: int | None = None, wide: float = 0.0, prefill: bool = False) -> None:
        """q: (heads * G, d) query heads of this step (a sparse-prefill chunk: heads * G *
        positions, grouped by KV head); sets ``selected`` (at most ``pages`` pages per KV head;
        default: the budget). ``wide``: the search covers at least this share of the keys.
        ``prefill``: for a sparse prefill (a chunk, or one of the prompt's last steps): the
        selector's ``select_prefill``."""
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
        choose = self.selector.select_prefill if prefill else self.selector.select
        self.selected = choose(qn, P, wide)
        self.stats.query_s += time.perf_counter() - t0

    def load(self) -> None:
        """Bring the selected pages into the pool: only those not resident (or stale)."""
        if self.spec.budget_pages == 0:
            return
        t0 = time.perf_counter()
        owner = self.anchor if self.anchor is not None else self
        pinned = self.passages.load if self.passages is not None else None
        loaded, moved = self.resident.load(self.selected, owner.selector.page_table, self.store, pinned)
        self.stats.bytes_moved += moved
        self.stats.pages_loaded += loaded
        self.stats.pages_selected += sum(len(w) for w in self.selected)
        self.backend.timer_sync()
        self.stats.load_s += time.perf_counter() - t0
