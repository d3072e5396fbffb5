"""``icecache bench decode``: time per output token and resident KV bytes, per method, same run.

For each context length, generated text of that many tokens goes once through the model's own
chunked full-attention prefill (every method prefills with full attention); each method starts
from a copy of that KV in its own cache, and ``steps`` decode steps are timed one by one after
``warmup`` untimed ones (the first of which builds the index: it is in the time to the second
token, ``tt2t_s`` = the shared prefill + the first decode step). With several methods the timed
steps are taken in interleaved rounds (:func:`interleaved`), so that a drift of the machine's
speed during the run does not favour the methods timed first.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..generation import Prefilled, Session, prefill_once
from ..measure import kv_bytes
from ..textgen import generated_text
from .warm import ensure_warm


@dataclass
class DecodeResult:
    method: str
    ctx: int
    budget: int
    prefill_s: float
    tt2t_s: float  # prefill + first decode step (index build included): time to the second token
    tpot_ms: float
    tpot_p90_ms: float
    device_kv_bytes: int
    host_kv_bytes: int
    device_kv_bytes_sparse_layers: int  # layers from dense_layers on (where ice is sparse)
    breakdown_ms: dict = field(default_factory=dict)
    pages_loaded_per_step: float = 0.0
    all_dense: bool = False  # every layer kept dense (ice within dense_until: exact attention)
    clamped: bool = False  # ... past the trained context, the farthest keys at its last distance
    # the mean step: the median (tpot_ms) leaves out the steps at which the layers' windows shed
    # a page into the index (one in page_size steps, every layer at once), a long generation does not
    tpot_mean_ms: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def context_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    ids: list[int] = []
    words = n
    while len(ids) < n:
        ids = tokenizer(generated_text(words, seed))["input_ids"]
        words = int(words * 1.3) + 16
    return ids[:n]


def prefill(loaded, settings, ctx: int, on_progress=None) -> Prefilled:
    """The model's own chunked full-attention prefill of ``ctx`` generated tokens, once.

    Every method's prefill is full attention, so each method then starts from a copy of this KV
    (:meth:`~icecache.generation.Session.adopt`). ``on_progress(done, total)``.
    """
    ensure_warm(loaded, settings, [])
    ids = context_ids(loaded.tokenizer, ctx)
    report = (lambda _phase, d, t: on_progress(d, t)) if on_progress else None
    return prefill_once(loaded, settings, ids, on_progress=report)


def run(loaded, settings, method: str, ctx: int, steps: int = 16, warmup: int = 2,
        on_progress=None, shared=None, linears: bool = False) -> DecodeResult:
    """Decode timing for ``method``; ``shared`` = a :func:`prefill` result to start from;
    ``linears``: time the linear layers too (:class:`LinearClock`)."""
    pre = shared or prefill(loaded, settings, ctx, on_progress)
    timer = start(loaded, settings, method, pre, warmup, linears, steps=steps)
    timer.advance(steps)
    return timer.result()


def start(loaded, settings, method: str, pre: Prefilled, warmup: int = 2,
          linears: bool = False, steps: int = 0) -> DecodeTimer:
    """A :class:`DecodeTimer` for ``method`` from a copy of the prefill ``pre`` (its warm-up
    steps done). The run is planned (positions, ``dense_until``) for the prompt and the
    ``warmup + steps + 1`` tokens it decodes, as a user's run of that length is."""
    ensure_warm(loaded, settings, [method])
    session = Session(loaded, settings, method)
    session.adopt(pre, new_tokens=warmup + steps + 1)
    return DecodeTimer(session, pre.logits, pre.seconds, warmup, linears=linears)


def is_linear(module: torch.nn.Module) -> bool:
    """A linear layer of the model: torch's own or a quantized one (each of those names its
    ``form``: icecache.weights, icecache.head, icecache.gguf_weights)."""
    return isinstance(module, torch.nn.Linear) or getattr(module, "form", None) is not None


class LinearClock:
    """While entered, sums the wall time spent inside the model's linear layers (the LM head
    included), by forward hooks. On the CPU a layer's ops run before its forward returns, so
    the time between its two hooks is the layer's own. The hooks add a few microseconds per
    layer to the step outside what they time. The decode step's joined int4 products
    (:meth:`~icecache.fast_step.Int4Layer.product_of`, which call no module) are timed too; the
    fused layers (:mod:`~icecache.fused_step`, which call no module either) are paused while it
    is entered, so the clock times the torch step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.seconds = 0.0
        self._handles: list = []
        self._t0 = 0.0
        self._product_of = None
        self._unfused = None

    def _timed_product(self, x, joined):
        t0 = time.perf_counter()
        y = self._product_of(x, joined)
        self.seconds += time.perf_counter() - t0
        return y

    def _pre(self, _module, _args):
        self._t0 = time.perf_counter()

    def _post(self, _module, _args, _out):
        self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> LinearClock:
        for mod in self.model.modules():
            if is_linear(mod):
                self._handles.append(mod.register_forward_pre_hook(self._pre))
                self._handles.append(mod.register_forward_hook(self._post))
        from ..fast_step import Int4Layer
        from ..fused_step import unfused

        self._product_of = Int4Layer.product_of
        Int4Layer.product_of = staticmethod(self._timed_product)
        self._unfused = unfused()
        self._unfused.__enter__()  # (left in __exit__)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._product_of is not None:
            from ..fast_step import Int4Layer

            Int4Layer.product_of = staticmethod(self._product_of)
            self._product_of = None
        if self._unfused is not None:
            self._unfused.__exit__(None, None, None)
            self._unfused = None


def interleaved(timers: list[DecodeTimer], steps: int, rounds: int) -> list[DecodeResult]:
    """``steps`` timed steps per timer, in ``rounds`` turns taken in order (A B C A B C ...), so
    that a machine whose speed drifts during the run slows every method alike."""
    per = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    for n in per:
        for t in timers:
            t.advance(n)
    return [t.result() for t in timers]


def time_decode(session, logits, prefill_s: float, steps: int = 16,
                warmup: int = 2, on_step=None, between=None, turns: int = 1) -> DecodeResult:
    """Time ``steps`` greedy decode steps of a session whose cache holds the prompt, after
    ``warmup`` untimed ones (the first of which builds the index when the cache is not built
    yet: it counts in the time to the second token, ``prefill_s`` + that step). With
    ``between``, the steps are taken in ``turns`` blocks of about equal size, and
    ``between(n)`` runs after each block of ``n`` (another method's steps, timed in turns with
    these)."""
    timer = DecodeTimer(session, logits, prefill_s, warmup, on_step, planned=steps)
    blocks = max(1, min(turns, steps)) if between is not None else 1
    for b in range(blocks):
        n = steps * (b + 1) // blocks - steps * b // blocks
        timer.advance(n)
        if between is not None:
            between(n)
    return timer.result()


class DecodeTimer:
    """Greedy decode steps of one session, timed one by one and resumable: the ``warmup``
    untimed steps run at once (the first builds the index when the cache is not built yet: it
    counts in the time to the second token, ``prefill_s`` + that step); :meth:`advance` times
    more; :meth:`result` sums up the timed steps so far."""

    def __init__(self, session, logits, prefill_s: float, warmup: int = 2, on_step=None,
                 planned: int = 0, linears: bool = False):
        self.session, self.prefill_s, self.warmup = session, prefill_s, warmup
        self.linears = linears  # also time the linear layers (LinearClock) in the timed steps
        self.linears_s = 0.0
        self.on_step, self.planned = on_step, planned
        self.token = int(torch.argmax(logits))
        self.tokens: list[int] = []  # the greedy tokens fed so far
        self.times: list[float] = []
        # each timed step's stage seconds (index query, page loading, ice attention), beside its time
        self.stages: list[tuple[float, float, float]] = []
        self.loaded_pages = 0.0
        self.done = 0
        self.tt2t = float("nan")  # set by the first step, warm-up or timed
        for _ in range(warmup):
            self._step(timed=False)

    def _step(self, timed: bool) -> None:
        self.tokens.append(self.token)
        s0 = _stats(self.session.cache) if timed else None
        with torch.inference_mode():
            t = time.perf_counter()
            logits = self.session.forward([self.token])
            dt = time.perf_counter() - t
        self.token = int(torch.argmax(logits))
        self.done += 1
        if self.done == 1:  # the prefill + this first step (only its own): the time to the second token
            self.tt2t = self.prefill_s + time.perf_counter() - t
        if timed:
            self.times.append(dt)
            s1 = _stats(self.session.cache)
            if s0 and s1:
                self.stages.append(tuple(s1[key] - s0[key] for _, key in STAGES))
                self.loaded_pages += s1["pages_loaded"] - s0["pages_loaded"]
        if self.on_step is not None:  # (steps done, steps in all, timed step seconds, session)
            self.on_step(self.done, self.warmup + self.planned, self.times, self.session)

    def advance(self, steps: int) -> None:
        """``steps`` more timed steps, each with the cache's stage counters over it."""
        self.session.activate()  # another timer's session may have used the model since
        clock = LinearClock(self.session.loaded.model) if self.linears else None
        with clock or contextlib.nullcontext():
            for _ in range(steps):
                self._step(timed=True)
        if clock is not None:
            self.linears_s += clock.seconds

    def result(self) -> DecodeResult:
        session, settings = self.session, self.session.settings
        dev, host, sparse = kv_bytes(session.cache, settings.dense_layers)
        n = len(self.times)
        breakdown, loaded_pages = {}, 0.0
        if n and (self.linears or self.stages):
            # Medians over the timed steps, as the TPOT is: each stage's, and the rest's (a step's
            # time less its stages), so that the few steps that evict into the index (the p90's)
            # weigh on no part more than on the TPOT; the parts sum to about the median step.
            rest = np.array(self.times)
            if self.stages:
                stages = np.array(self.stages)
                breakdown = {name: 1000 * float(np.median(stages[:, i])) for i, (name, _) in enumerate(STAGES)}
                rest = rest - stages.sum(axis=1)
                loaded_pages = self.loaded_pages / len(self.stages)
            rest_ms = 1000 * float(np.median(rest))
            if self.linears:  # timed over all the steps together: its mean
                breakdown["linears"] = 1000 * self.linears_s / n
                rest_ms -= breakdown["linears"]
            breakdown["rest_of_model"] = rest_ms
        return DecodeResult(
            method=session.method, ctx=len(session.cached_ids) - self.done, budget=settings.budget,
            prefill_s=self.prefill_s, tt2t_s=self.tt2t, tpot_ms=1000 * float(np.median(self.times)),
            tpot_p90_ms=1000 * float(np.percentile(self.times, 90)), tpot_mean_ms=1000 * float(np.mean(self.times)),
            device_kv_bytes=dev, host_kv_bytes=host, device_kv_bytes_sparse_layers=sparse,
            breakdown_ms=breakdown, pages_loaded_per_step=loaded_pages, all_dense=session.all_dense,
            clamped=session.clamped)


# the breakdown's stages, each with the cache's counter of it
STAGES = (("index_query", "query_s"), ("page_loading", "load_s"), ("ice_attention", "attention_s"))


def _stats(cache):
    st = getattr(cache, "stats", None)
    if st is None:
        return None
    return {"query_s": st.query_s, "load_s": st.load_s, "attention_s": st.attention_s,
            "pages_loaded": st.pages_loaded}
