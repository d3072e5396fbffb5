"""``icecache bench --ctx ...``: per method and context, in one run, the figures users compare.

Each context's document is generated text run through the model's real prefill:

- up to ``full_prefill_max`` tokens, one full-attention prefill shared by every method (each
  starts from a copy of its keys and values; every method's own prefill would compute the same);
- beyond it, the ``ice`` sparse prefill (``--prefill sparse``): ``ice`` decodes from its own
  cache, and the other methods from the dense keys and values rebuilt from it (sink + host
  store + window, in token order), labelled ``kv_source: sparse prefill`` (dense decode time
  does not depend on the values).

Per method: time to the second token (the prefill + the first decode step, index build
included), prefill tokens/s, time per output token (median, p90 and mean over the timed steps
after warm-up: the median leaves out the steps at which every layer sheds a window page into
its index, the mean does not), the per-token breakdown, resident and host KV bytes, peak RSS
(sampled) and the ratio of every TPOT to ``full``'s and ``dense``'s at the same context. A method that fails (out of
memory) or whose decode step is over ``max_seconds`` is reported with its reason, and the bench
goes on. Before a method starts, its memory need is estimated (:mod:`icecache.memory`) and
compared with what is available; one that cannot fit gets a ``skipped`` row with the figures
instead of running (and the run goes on). ``on_row`` receives each row as soon as it is measured.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..generation import Prefilled, Session, prefill_once
from ..measure import PeakRss, kv_bytes
from ..memory import Need, available_bytes, need_bytes, shortfall
from ..methods import get, reads_prompt_queries
from . import llama_cpp
from .decode_bench import context_ids, time_decode
from .warm import ensure_warm


@dataclass
class BenchRow:
    method: str
    ctx: int
    positions: str = ""  # how the run set RoPE positions: remap or true (the session's choice)
    all_dense: bool = False  # every layer kept dense (ice within dense_until: exact attention)
    clamped: bool = False  # ... past the trained context, the farthest keys at its last distance
    status: str = "ok"  # ok | skipped (would not fit in memory) | out of memory | over time cap | failed (llama.cpp)
    reason: str = ""
    kv_source: str = ""
    tt2t_s: float | None = None
    prefill_tok_s: float | None = None
    tpot_ms: float | None = None
    tpot_p90_ms: float | None = None
    tpot_mean_ms: float | None = None  # the mean step (with the steps that shed pages into the index)
    device_kv_bytes: int | None = None
    peak_device_bytes: int | None = None  # GPU: max_memory_allocated; CPU: the most KV resident
    gpu: bool = False  # measured on a GPU (peak_device_bytes then counts the weights too)
    host_kv_bytes: int | None = None
    peak_rss_bytes: int | None = None
    breakdown_ms: dict = field(default_factory=dict)
    tpot_ratio_vs_full: float | None = None
    tpot_ratio_vs_dense: float | None = None
    tpot_ratio_vs_llama_cpp: float | None = None  # llama.cpp's TPOT over this row's (> 1: faster)

    def as_dict(self) -> dict:
        return asdict(self)

    def timed(self, t) -> None:
        """The time to the second token and the step figures (median, p90, mean) of ``t``: our
        methods' :class:`~.decode_bench.DecodeResult` or llama.cpp's :class:`~.llama_cpp.Timing`."""
        self.tt2t_s, self.tpot_ms, self.tpot_p90_ms, self.tpot_mean_ms = t.tt2t_s, t.tpot_ms, t.tpot_p90_ms, t.tpot_mean_ms


def release_current_cache() -> None:
    """Forget the ice attention's pointer to the last cache used (it would keep a finished
    method's host store alive while the next method runs)."""
    from ..cache import current

    current.forget()


def _measure(row: BenchRow, session: Session, logits, prefill_s: float, steps: int, warmup: int,
             max_seconds: float | None, on_step=None, resident_peak: int = 0, llama=None) -> BenchRow:
    """Decode timing into ``row``; a first step over ``max_seconds`` stops the method there.
    ``resident_peak``: the most KV the session held during its prefill, if known (CPU).
    ``llama``: llama.cpp's run held open (:class:`_LlamaTurns`): its steps are taken in turns
    with this method's, and the row's ratio to llama.cpp is to those steps."""
    cuda = torch.cuda.is_available() and session.loaded.model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    resident_before = kv_bytes(session.cache, session.settings.dense_layers)[0] if session.cache is not None else 0
    try:
        with PeakRss() as peak:
            if max_seconds is not None:  # one untimed probe step decides whether to go on
                t = time.perf_counter()
                with torch.inference_mode():
                    logits = session.forward([int(torch.argmax(logits))])
                probe = time.perf_counter() - t
                if probe > max_seconds:
                    row.status, row.reason = "over time cap", f"a decode step took {probe:.1f} s > {max_seconds:g} s"
                    return row
                prefill_s += probe
                warmup = max(0, warmup - 1)
            at, between = (None, None) if llama is None else (llama.mark(), llama.take)
            r = time_decode(session, logits, prefill_s, steps, warmup, on_step=on_step, between=between,
                            turns=TURNS)
    except (MemoryError, torch.OutOfMemoryError) as exc:
        row.status, row.reason = "out of memory", str(exc).splitlines()[0][:200]
        return row
    row.timed(r)
    row.device_kv_bytes, row.host_kv_bytes = r.device_kv_bytes, r.host_kv_bytes
    row.peak_device_bytes = (torch.cuda.max_memory_allocated() if cuda
                             else max(resident_before, resident_peak, r.device_kv_bytes))
    row.gpu = cuda
    row.breakdown_ms, row.peak_rss_bytes = r.breakdown_ms, peak.peak
    row.positions = session.positions
    row.all_dense, row.clamped = session.all_dense, session.clamped
    if llama is not None:
        llama_ms = llama.tpot_ms(at)
        if llama_ms is not None:
            row.tpot_ratio_vs_llama_cpp = llama_ms / row.tpot_ms
    return row


def _ratios(row: BenchRow, rows: list[BenchRow]) -> BenchRow:
    """``row``'s TPOT ratios to full's, dense's and llama.cpp's rows measured so far (a ratio to
    llama.cpp that :func:`_measure` took from the steps timed in turns with the row's stays)."""
    for base, field_name in (("full", "full"), ("dense", "dense"), (llama_cpp.NAME, "llama_cpp")):
        ref = next((r for r in rows if r.method == base and r.status == "ok" and r.tpot_ms), None)
        name = f"tpot_ratio_vs_{field_name}"
        if row.status == "ok" and ref is not None and (base != llama_cpp.NAME or getattr(row, name) is None):
            setattr(row, name, ref.tpot_ms / row.tpot_ms)
    return row


def _method_skip(loaded, settings, method: str, tokens: int) -> str | None:
    """Why ``method`` cannot start (its cache would not fit in the memory available), or None."""
    return shortfall(need_bytes(method, loaded.model.config, settings, tokens), available_bytes(settings))


def _shared_prefill_skip(loaded, settings, ctx: int, full: bool) -> str | None:
    """Why the prefill the methods start from cannot run, or None: a full prefill holds its dense
    cache and the copy it hands over (on a GPU in host memory: :func:`prefill_once`); a longer
    context's sparse prefill is ice's own."""
    if full:  # the dense cache, and the copy handed over (on a GPU, in host memory)
        need = need_bytes("dense", loaded.model.config, settings, ctx)
        need = Need(device=need.device, host=2 * need.host + need.device)
    else:
        need = need_bytes("ice", loaded.model.config, settings.replace(prefill="sparse"), ctx)
    short = shortfall(need, available_bytes(settings))
    return None if short is None else f"the shared {'full' if full else 'sparse'} prefill {short}"


def run_ctx(loaded, settings, methods: list[str], ctx: int, steps: int = 16, warmup: int = 2,
            full_prefill_max: int = 32768, max_seconds: float | None = None,
            log=lambda _m: None, on_progress=None, on_step=None, on_row=None,
            gguf: Path | None = None) -> list[BenchRow]:
    """The rows of ``methods`` at ``ctx`` tokens. ``llama.cpp`` among them (:mod:`.llama_cpp`)
    prefills the GGUF file ``gguf`` with the same token ids first and stays open: its decode
    steps are then timed in turns with each icecache method's (:data:`TURNS` blocks each), so
    that each icecache row carries, as soon as it is measured, its ratio to llama.cpp's steps of
    the same minutes (this machine's speed drifts from one minute to the next, by up to 2x at
    1k tokens: two rows timed a minute apart compared the drift as much as the methods).
    llama.cpp's row, over all its steps, comes last."""
    ours = [m for m in methods if m != llama_cpp.NAME]
    ensure_warm(loaded, settings, ours, sparse=ctx > full_prefill_max)
    ids = context_ids(loaded.tokenizer, ctx)
    rows: list[BenchRow] = []

    def emit(row: BenchRow) -> None:
        if on_row is not None:
            on_row(_ratios(row, rows))

    llama = None
    if llama_cpp.NAME in methods:
        row, held = _open_llama(loaded, settings, ids, steps * max(1, len(ours)), warmup, gguf, log, on_progress)
        rows.append(row)
        if held is None:
            emit(row)
        else:
            llama = _LlamaTurns(row, held, log)
    try:
        if ours:
            _run_ours(loaded, settings, ours, ids, steps, warmup, full_prefill_max, max_seconds,
                      log, on_progress, on_step, rows, emit, llama)
        if llama is not None:
            if llama.mark() == 0:  # no method of ours timed beside it (or none asked for)
                llama.take(steps)
            llama.finish()
            emit(llama.row)
    finally:
        if llama is not None:
            llama_cpp.close(llama.held.llm)
    for r in rows:
        _ratios(r, rows)
    order = {m: i for i, m in enumerate(methods)}
    return sorted(rows, key=lambda r: order[r.method])


TURNS = 4  # blocks a method's timed steps are cut into, llama.cpp's taken between them


def _open_llama(loaded, settings, ids: list[int], steps: int, warmup: int, gguf: Path | None,
                log, on_progress) -> tuple[BenchRow, llama_cpp.LlamaSteps | None]:
    """The llama.cpp row and its run held open (its own prefill of ``ids`` and its warm-up steps
    done; room for ``steps`` timed steps), or the row skipped or failed and None."""
    ctx = len(ids)
    row = BenchRow(llama_cpp.NAME, ctx, kv_source="own prefill (llama.cpp)")
    why = llama_cpp.missing() or (None if gguf is not None else "llama.cpp reads GGUF files only")
    need = llama_cpp.kv_cache_bytes(loaded.model.config, ctx + warmup + steps + 1)
    short = why or shortfall(Need(device=0, host=need), available_bytes(settings))
    if short is not None:
        row.status, row.reason = "skipped", short
        log(f"llama.cpp at {ctx} tokens: skipped, {short}")
        return row, None
    log(f"llama.cpp at {ctx} tokens: prefill ...")
    progress = (lambda d, t: on_progress("prefill", d, t)) if on_progress else None
    try:
        with PeakRss() as peak:
            held = llama_cpp.open_run(gguf, ids, steps, warmup, torch.get_num_threads(), progress)
    except (RuntimeError, ValueError, OSError, MemoryError) as exc:  # llama.cpp could not run it
        _failed(row, exc, log)
        return row, None
    row.prefill_tok_s = ctx / held.prefill_s
    row.device_kv_bytes = row.peak_device_bytes = need
    row.peak_rss_bytes = peak.peak
    return row, held


def _failed(row: BenchRow, exc: BaseException, log) -> None:
    row.status, row.reason = "failed", (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    log(f"llama.cpp at {row.ctx} tokens: failed, {row.reason}")


class _LlamaTurns:
    """llama.cpp's run held open while the icecache methods decode: :meth:`take` times its next
    steps (between a method's blocks), :meth:`finish` writes its row."""

    def __init__(self, row: BenchRow, held: llama_cpp.LlamaSteps, log):
        self.row, self.held, self.log = row, held, log

    def mark(self) -> int:
        """Timed steps so far (where a method's turns begin)."""
        return len(self.held.times)

    def take(self, steps: int) -> None:
        if self.row.status != "ok":
            return
        try:
            with PeakRss() as peak:
                self.held.advance(steps)
        except (RuntimeError, ValueError, OSError, MemoryError) as exc:
            _failed(self.row, exc, self.log)
        self.row.peak_rss_bytes = max(self.row.peak_rss_bytes or 0, peak.peak)

    def tpot_ms(self, since: int) -> float | None:
        """The median of the steps timed from step ``since`` on (None: none, or it failed)."""
        times = self.held.times[since:]
        return 1000 * float(np.median(times)) if times and self.row.status == "ok" else None

    def finish(self) -> None:
        if self.row.status != "ok":
            return
        self.row.timed(self.held.timing())


def _run_ours(loaded, settings, methods: list[str], ids: list[int], steps: int, warmup: int,
              full_prefill_max: int, max_seconds: float | None, log, on_progress, on_step,
              rows: list[BenchRow], emit, llama=None) -> None:
    """The icecache methods' rows (see the module's docstring), appended to ``rows`` and each
    given to ``emit`` as soon as it is measured; ``llama``: llama.cpp's run, timed in turns with
    each (:func:`_measure`)."""
    ctx = len(ids)
    shared_need = _shared_prefill_skip(loaded, settings, ctx, ctx <= full_prefill_max)
    if shared_need is not None:  # the prefill every method starts from cannot fit
        for m in methods:
            rows.append(BenchRow(m, ctx, status="skipped", reason=shared_need))
            emit(rows[-1])
        return
    if ctx <= full_prefill_max:
        log(f"full-attention prefill of {ctx} tokens (shared by the methods) ...")
        # the prompt's queries are kept only for a method that reads them (snapkv, h2o): keeping
        # them cost 9% of the prefill's speed at 8k, which a user's run never pays
        observe = settings.tuned("observation") if any(reads_prompt_queries(get(m)) for m in methods) else 0
        pre = prefill_once(loaded, settings, ids, observation=observe, on_progress=on_progress)
        source = "full prefill (shared)"
        todo = methods
    else:
        log(f"sparse prefill of {ctx} tokens (ice) ...")
        session = Session(loaded, settings.replace(prefill="sparse"), "ice")
        session.new_tokens = warmup + steps + 1
        with PeakRss() as peak:
            _, stats = session.prefill(ids, on_progress, hold_tail=True)
            # the chunks' pool and window are resident until the prompt's stepped end shrinks them
            chunk_resident = kv_bytes(session.cache, settings.dense_layers)[0]
            logits = session.finish_prefill(stats)
        source = "sparse prefill (ice)"
        if "ice" in methods:
            row = BenchRow("ice", ctx, kv_source="own sparse prefill",
                           prefill_tok_s=len(ids) / stats.prefill_seconds)
            log(f"ice at {ctx} tokens: decoding ...")
            rows.append(_measure(row, session, logits, stats.prefill_seconds, steps, warmup, max_seconds,
                                 on_step, resident_peak=chunk_resident, llama=llama))
            rows[-1].peak_rss_bytes = max(rows[-1].peak_rss_bytes or 0, peak.peak)
            emit(rows[-1])
        todo = [m for m in methods if m != "ice"]
        session.cache.release_indexes()  # the rebuild needs the stores, not the indexes
        # the others' keys and values, built in host memory layer by layer (a GPU holds one
        # layer's copy at a time; each method's cache then copies them onto the device)
        pre = Prefilled(list(ids), session.cache.dense_kv("cpu") if todo else [], logits,
                        stats.prefill_seconds)
        del session
        release_current_cache()
        gc.collect()
    for method in todo:
        row = BenchRow(method, ctx, kv_source=source, prefill_tok_s=len(ids) / pre.seconds)
        too_big = _method_skip(loaded, settings, method, ctx + warmup + steps + 1)
        if too_big is not None:
            row.status, row.reason = "skipped", too_big
            log(f"{method} at {ctx} tokens: skipped, {too_big}")
            rows.append(row)
            emit(row)
            continue
        log(f"{method} at {ctx} tokens: decoding ...")
        try:
            session = Session(loaded, settings, method)
            session.adopt(pre, new_tokens=warmup + steps + 1)  # planned as a user's run of this length
        except (MemoryError, torch.OutOfMemoryError) as exc:
            row.status, row.reason = "out of memory", str(exc).splitlines()[0][:200]
            rows.append(row)
            emit(row)
            continue
        rows.append(_measure(row, session, pre.logits, pre.seconds, steps, warmup, max_seconds, on_step,
                             llama=llama))
        emit(rows[-1])
        del session
        release_current_cache()
        gc.collect()
