"""Greedy generation over a KV cache, with chunked prefill and prefix reuse.

A :class:`Session` owns one model and one cache for one sequence at a time. When the next prompt
shares a prefix with what the cache already holds (several questions over one document), the
cache is cut back to the shared prefix and only the rest is prefilled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .cache import IceCache
from .cache.window import kv_in_order, seen
from .chat import cut_at_cue, stop_cues, stop_token_ids
from .config import Settings
from .doc_prefix import DocPrefixes
from .fast_step import fast_step_for
from .memory import return_freed
from .methods import dense_plan, make_cache, plan_run, prepare_model, prompt_half, tail_steps
from .models import LoadedModel
from .weights import prompt_products

# on_progress(phase, done, total): phase is "prefill" (tokens) or "decode" (new tokens).
Progress = Callable[[str, int, int], None]


@dataclass
class GenerationStats:
    tokens_in: int = 0  # prompt tokens
    tokens_prefilled: int = 0  # prompt tokens computed now (the rest came from a cached prefix)
    tokens_out: int = 0
    prefix_cached_tokens: int = 0  # prompt tokens loaded from the document cache (doc_cache.py)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)

    def decode_line(self) -> str:
        """The decode's figures in words: the first step apart (it carries one-time work: the
        cached kernels loaded, the fused layers made), the later steps' mean, a TPOT."""
        steps = self.step_seconds
        new = f"{self.tokens_out} new token{'' if self.tokens_out == 1 else 's'}"
        if len(steps) < 2:
            return f"{new} in {1000 * self.decode_seconds:.1f} ms"
        later = 1000 * sum(steps[1:]) / (len(steps) - 1)
        return (f"{new} at {later:.1f} ms/token after the first step "
                f"({1000 * steps[0]:.1f} ms, with one-time set-up)")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def penalize_repeats(logits: torch.Tensor, previous: list[int], penalty: float) -> torch.Tensor:
    """``logits`` (vocab,) with the tokens in ``previous`` made less likely by ``penalty``."""
    idx = torch.tensor(sorted(set(previous)), dtype=torch.long, device=logits.device)
    seen = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def chunk_bounds(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    """Prefill chunks of tokens ``lo .. hi-1``, ``chunk`` tokens each (the last may be shorter)."""
    return [(a, min(a + chunk, hi)) for a in range(lo, hi, chunk)]


@dataclass
class Prefilled:
    """A prompt's dense prefill, to seed sessions of any method (:meth:`Session.adopt`)."""

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, H, T, d)
    logits: torch.Tensor  # at the last prompt position
    seconds: float
    obs_queries: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt-end queries per layer
    grids: dict = field(default_factory=dict)  # per layer: a QueryGrid of the prompt's queries (H2O)


@torch.inference_mode()
def prefill_once(loaded: LoadedModel, settings: Settings, ids: list[int], observation: int | None = None,
                 on_progress: Progress | None = None, new_tokens: int = 0) -> Prefilled:
    """The chunked full-attention prefill of ``ids`` that every method's own prefill computes.

    Every method prefills with full attention (the sparse ones change decoding only), so one
    prefill serves them all: each then starts from a copy of these keys and values. The last
    ``observation`` queries of each layer are kept for SnapKV and H2O (None: the settings'
    ``observation``; 0: none). ``new_tokens``: the generation to
    come (with ``rope_scaling``, the RoPE is chosen for prompt + generation, as a session does).

    A sliding-window layer keeps only its window, as every method's cache does (:meth:`Session.adopt`
    takes it so): its chunks attend over the window and the chunk, not over the whole prompt under
    a mask that hides all but the window, and the copy handed over holds no rows the model never
    reads again.
    """
    from .cache import DenseCache, record
    from .cache.window import window_sizes
    from .methods import set_rope

    model = loaded.model
    set_rope(model, settings, len(ids) + new_tokens)
    name = record.register()
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
    record.start(settings.tuned("observation") if observation is None else observation)
    layers = model.config.num_hidden_layers
    cache = DenseCache(layers, windows=window_sizes(model.config, layers))
    t0 = time.perf_counter()
    chunk = settings.chunk_size
    with prompt_products(prompt_half(settings, model.device)):
        for lo in range(0, len(ids), chunk):
            x = torch.tensor([ids[lo : lo + chunk]], dtype=torch.long, device=model.device)
            out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            if on_progress:
                on_progress("prefill", min(lo + chunk, len(ids)), len(ids))
    seconds = time.perf_counter() - t0
    queries, grids = record.recorded(), record.grids()
    record.start(0)
    # the copy every method starts from: on a GPU in host memory (each method's cache copies it
    # onto the device), so that the device never holds the prompt's keys and values twice
    return Prefilled(list(ids), [tuple(_host_copy(t) for t in kv_in_order(layer)) for layer in cache.layers],
                     out.logits[0, -1], seconds, dict(queries), dict(grids))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.device.type == "cpu" else t.to("cpu")


class Session(DocPrefixes):
    def __init__(self, loaded: LoadedModel, settings: Settings, method: str = "full"):
        self.loaded = loaded
        self.settings = settings
        self.method = method
        self.stop_ids = stop_token_ids(loaded)
        self.stop_cues = stop_cues(loaded)
        self.cache = None
        self.cached_ids: list[int] = []  # the tokens whose keys and values the cache holds
        self.new_tokens = 0  # the generation room of the current run (positions: auto reads it)
        self.run_settings: Settings | None = None  # settings with this run's choices made
        self._run_tokens = 0  # the run's prompt + generation tokens (its RoPE depends on them)
        # what prefill() left to finish_prefill(): prompt tokens for decode steps, the prompt's
        # token count, the progress callback and the chunks' last logits
        self._pending: tuple[list[int], int, Callable, torch.Tensor | None] | None = None
        # on_token(tokens so far, stats): called with [] when a generation starts and after each
        # new token (the live panel and streamed text read it).
        self.on_token: Callable[[list[int], GenerationStats], None] | None = None
        # The document cache (doc_cache.DocCache) and the prompt length from which it is used.
        self.doc_cache = None
        self.doc_min_tokens = settings.doc_cache_min_tokens

    def forward(self, ids: list[int]) -> torch.Tensor:
        """Run ``ids`` (prompt chunk or one new token) through the model into the cache; return
        the logits at the last position. One decode step is ``forward([token])``."""
        model = self.loaded.model
        fast = fast_step_for(model) if len(ids) == 1 else None
        if fast is not None:
            logits = fast.step(ids[0], self.cache)
            self.cached_ids.extend(ids)
            return logits
        x = torch.tensor([ids], dtype=torch.long, device=model.device)
        out = model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cached_ids.extend(ids)
        return out.logits[0, -1]

    def _start(self, ids: list[int]) -> int:
        """Prepare the cache for prompt ``ids``; return how many leading tokens are already in it."""
        keep = min(_common_prefix(self.cached_ids, ids), len(ids) - 1)
        # a cache kept dense for a short run serves another run only as that run would make it
        # (within dense_until; distances clamped past the trained context or not)
        outgrown = False
        if self.ice is not None and self.ice.all_dense:
            dense, clamp = dense_plan(self.method, self.loaded.model, self.settings, len(ids) + self.new_tokens,
                                      len(ids))
            outgrown = not dense or (clamp is not None) != self.cache.clamped
        if self.cache is not None and keep > 0 and self.cache.is_croppable and not outgrown:
            drop = len(self.cached_ids) - keep
            try:
                if drop:
                    self.cache.crop(-drop)  # a negative count removes that many trailing tokens
                del self.cached_ids[keep:]
                return keep
            except RuntimeError:
                pass  # a layer that cannot roll back (transformers' sliding-window layers, once full): start afresh
        self.cache = None  # the old cache's memory goes before the new one takes any
        self.cached_ids = []
        self.cache = self._new_cache(len(ids))
        return 0

    def _new_cache(self, prompt_tokens: int):
        """A cache for a prompt of ``prompt_tokens``: the prefill mode and positions decided
        for this run (``run_settings``)."""
        self.run_settings = plan_run(self.method, self.loaded.model, self.settings, prompt_tokens,
                                     self.new_tokens)
        self._run_tokens = prompt_tokens + self.new_tokens
        return make_cache(self.method, self.loaded.model, self.run_settings, self._run_tokens, prompt_tokens)

    def activate(self) -> None:
        """Set the shared model back to this Session's method (its attention) and run (its RoPE),
        after another Session stepped in between (benchmarks interleave them)."""
        if self.run_settings is not None:
            prepare_model(self.method, self.loaded.model, self.run_settings, self._run_tokens)

    @property
    def positions(self) -> str:
        """How the current run sets RoPE positions: ``remap`` or ``true``."""
        return self.run_settings.positions if self.run_settings else "true"

    @property
    def ice(self) -> IceCache | None:
        """The cache when it is an ice cache (pages, prefill hooks, forks); None for the other
        methods' caches, which are plain transformers caches to a session."""
        return self.cache if isinstance(self.cache, IceCache) else None

    @property
    def all_dense(self) -> bool:
        """Whether the current run keeps every layer dense (``dense_until``: a short run)."""
        return self.ice is not None and self.ice.all_dense

    @property
    def clamped(self) -> bool:
        """Whether the current all-dense run attends to keys past the trained context at its
        last distance (``GrowingLayer.clamp``)."""
        return self.ice is not None and self.ice.clamped

    @property
    def prefill_mode(self) -> str:
        """The current run's prefill: ``full`` or ``sparse``."""
        return self.run_settings.prefill if self.run_settings else self.settings.prefill

    @torch.inference_mode()
    def adopt(self, pre: Prefilled, new_tokens: int | None = None) -> None:
        """A fresh cache of ``self.method`` holding a copy of ``pre``'s keys and values,
        planned for ``new_tokens`` tokens of generation after it (default: ``self.new_tokens``)."""
        if new_tokens is not None:
            self.new_tokens = new_tokens
        self.cache = self._new_cache(len(pre.ids))
        T = len(pre.ids)
        for i, (k, v) in enumerate(pre.kv):
            if self.ice is not None:  # the prompt's queries, for a selector that votes
                grid = pre.grids.get(i)
                if grid is not None and len(grid):
                    q, pos, _ = grid.arrays(T)
                    self.cache.observe(i, torch.from_numpy(q), pos)
                q = pre.obs_queries.get(i)
                if q is not None:  # the prompt's end last (SnapKV keeps the last call's)
                    self.cache.observe(i, q, np.arange(T - q.shape[1], T))
            device = self.loaded.model.device  # a copy on it (a GPU's shared prefill is on the host)
            self.cache.update(*(t.clone() if t.device == device else t.to(device) for t in (k, v)), i)
            seen(self.cache.layers[i], T)  # a window layer given its window's rows alone
        self.cached_ids = list(pre.ids)

    @torch.inference_mode()
    def generate_from(self, pre: Prefilled, max_new_tokens: int, on_progress: Progress | None = None,
                      repetition_penalty: float = 1.0) -> tuple[list[int], GenerationStats]:
        """:meth:`generate` for ``pre.ids``, starting from the shared prefill ``pre``."""
        self.adopt(pre, max_new_tokens)
        stats = GenerationStats(tokens_in=len(pre.ids), tokens_prefilled=len(pre.ids),
                                prefill_seconds=pre.seconds)
        return self._decode(pre.logits, max_new_tokens, stats, on_progress, repetition_penalty)

    @torch.inference_mode()
    def generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        on_progress: Progress | None = None,
        repetition_penalty: float = 1.0,
        prefix: int = 0,
    ) -> tuple[list[int], GenerationStats]:
        """Greedy continuation of prompt ``ids``: up to ``max_new_tokens`` tokens, stop token excluded.

        ``prefix``: the prompt's first tokens that other prompts share (the document): with a
        document cache, they are loaded from it when saved, else saved after their prefill.

        ``repetition_penalty`` > 1 makes tokens already generated (not the prompt's, which the
        answer may need to quote) less likely: positive logits are divided by it, negative ones
        multiplied. Decoding stays deterministic.
        """
        self.new_tokens = max_new_tokens
        logits, stats = self.prefill(ids, on_progress, prefix=prefix)
        return self._decode(logits, max_new_tokens, stats, on_progress, repetition_penalty)

    @torch.inference_mode()
    def fork(self, settings: Settings) -> Session:
        """A session decoding this prefilled (not yet decoding) session's prompt under
        ``settings``, which may differ from ``self.settings`` in the budget only: a copy of the
        cache (:meth:`IceCache.forked`). ``ValueError`` where the budget shaped the prefill."""
        if settings.replace(budget=self.settings.budget) != self.settings:
            raise ValueError("a fork may change the budget only")
        if self.run_settings is None or self.ice is None:
            raise ValueError(f"method {self.method} has no prefilled cache to fork")
        twin = Session(self.loaded, settings, self.method)
        twin.cache = self.cache.forked(settings.budget_pages)
        twin.cached_ids = list(self.cached_ids)
        twin.new_tokens = self.new_tokens
        twin.run_settings = self.run_settings.replace(budget=settings.budget)
        twin._run_tokens = self._run_tokens
        if self._pending is not None:  # prompt tokens still to step through (budget-independent)
            tokens, total, report, logits = self._pending
            twin._pending = (list(tokens), total, report, None if logits is None else logits.clone())
        return twin

    @torch.inference_mode()
    def decode(self, logits: torch.Tensor, max_new_tokens: int,
               stats: GenerationStats | None = None) -> tuple[list[int], GenerationStats]:
        """The greedy continuation after :meth:`prefill` (whose logits start it)."""
        stats = stats or GenerationStats(tokens_in=len(self.cached_ids))
        return self._decode(logits, max_new_tokens, stats, None, 1.0)

    @torch.inference_mode()
    def prefill(self, ids: list[int], on_progress: Progress | None = None, hold_tail: bool = False,
                prefix: int = 0):
        """Bring the cache to prompt ``ids`` (reusing a cached prefix where it can); return the
        logits at the last prompt position and the stats so far.

        A sparse prefill runs the prompt's last tokens as decode steps (:func:`~.methods.tail_steps`).
        ``hold_tail``: stop before them and return ``None`` logits; :meth:`finish_prefill` runs
        them (a :meth:`fork` taken in between carries them; bench measures the chunks' resident
        memory there)."""
        if not ids:
            raise ValueError("empty prompt")
        stats = GenerationStats(tokens_in=len(ids))
        report = on_progress or (lambda *_: None)
        start = self._start(ids)
        t0 = time.perf_counter()
        run = self.run_settings
        cut = len(ids) - tail_steps(run.prefill, run.prefill_queries, len(ids) - start)
        save_at, dc = self._doc_plan(prefix, start, cut, len(ids))
        if save_at and save_at >= cut:
            cut = save_at  # a sparse prefill: the prompt after the document runs as decode steps
        saved = self._load_prefix(ids, save_at, start, cut, dc) if save_at else False
        if saved:
            start = stats.prefix_cached_tokens = len(self.cached_ids)
            if start == save_at:
                save_at = 0  # (already saved)
        elif self.ice is not None:
            self.ice.begin_prefill(cut - start, tail=len(ids) - cut)
        stats.tokens_prefilled = len(ids) - start
        logits = None
        first = start
        # With a prefix to save, the chunks stop at its end (a later run that loads it continues
        # from there, so both compute the same chunks).
        bounds = (chunk_bounds(start, save_at, run.chunk_size) + chunk_bounds(save_at, cut, run.chunk_size)
                  if save_at else chunk_bounds(start, cut, run.chunk_size))
        with prompt_products(prompt_half(run, self.loaded.model.device)):
            for lo, hi in bounds:
                logits = self.forward(ids[lo:hi])
                report("prefill", hi - first, len(ids) - first)
                if save_at and hi == save_at:
                    self._save_prefix(ids[:save_at], dc)
        if self.ice is not None:
            self.ice.end_prefill()  # offload and index done: part of the prefill's time
        if len(ids) - start > run.chunk_size:
            return_freed()  # the chunks' transient buffers leave the RSS
        stats.prefill_seconds = time.perf_counter() - t0
        self._pending = (list(ids[cut:]), len(ids) - start, report, logits)
        if hold_tail:
            return None, stats
        return self.finish_prefill(stats), stats

    @torch.inference_mode()
    def finish_prefill(self, stats: GenerationStats | None = None) -> torch.Tensor:
        """Run the prompt tokens :meth:`prefill` left for decode steps; return the logits at the
        last prompt position."""
        if self._pending is None:
            raise ValueError("no prefill to finish")
        tokens, total, report, logits = self._pending
        self._pending = None
        t0 = time.perf_counter()
        with prompt_products(prompt_half(self.run_settings, self.loaded.model.device)):
            for j, token in enumerate(tokens):
                logits = self.forward([token])
                report("prefill", total - len(tokens) + j + 1, total)
        if stats is not None:
            stats.prefill_seconds += time.perf_counter() - t0
        return logits

    def _decode(self, logits, max_new_tokens: int, stats: GenerationStats,
                on_progress: Progress | None, repetition_penalty: float):
        report = on_progress or (lambda *_: None)
        watch = self.on_token or (lambda *_: None)
        out: list[int] = []
        watch(out, stats)
        t_dec = time.perf_counter()
        while True:
            if repetition_penalty != 1.0 and out:
                logits = penalize_repeats(logits, out, repetition_penalty)
            token = int(torch.argmax(logits).item())
            if token in self.stop_ids:
                break
            out.append(token)
            if self.stop_cues and cut_at_cue(self.loaded.tokenizer, out, self.stop_cues):
                break
            report("decode", len(out), max_new_tokens)
            watch(out, stats)
            if len(out) >= max_new_tokens:
                break
            t_step = time.perf_counter()
            logits = self.forward([token])
            stats.step_seconds.append(time.perf_counter() - t_step)
        stats.decode_seconds = time.perf_counter() - t_dec
        stats.tokens_out = len(out)
        return out, stats
