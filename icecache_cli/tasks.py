"""``icecache summarize``, ``icecache qa`` and ``icecache cot``: one document in, text out.

Every check that needs no model (flags, profile, method, the document itself, the generation
room) runs before anything else is printed or loaded; then the model loads, and a document's
own length and memory need are checked before its prefill.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from icecache.checks import SUMMARY_REPETITION_PENALTY, check_generation_room, check_questions, context_limit
from icecache.config import Settings, resolve_settings
from icecache.documents import read_document
from icecache.errors import InputError
from icecache.measure import kv_bytes, window_kv
from icecache.methods import check_prefill, get
from icecache.models import check_device, context_length_of, load_model, resolve_model_source

from .live import TextStream, memory_now, same_terminal
from .options import FileArg, RunOptions, max_new_opt, penalty_opt, with_options
from .output import Reporter, emit, panel_capable, stderr, user_errors, warn, write_out

if TYPE_CHECKING:  # torch and the model code load once a run starts, not for --help or a bad input
    from icecache.tasks import Runner, TaskResult

WAIT_NOTICE_S = 1.0  # an input that has given nothing for this long gets a line on a terminal


def _input_source(file: str | None) -> str:
    """FILE, or stdin when piped; a terminal with no FILE prints help. A closed stdin fails here,
    before the model source is resolved (a first run converts the embedded model there)."""
    if sys.stdin is None and file in (None, "-"):  # started with stdin closed (`<&-`)
        raise InputError("stdin is closed: give FILE, or pipe the document in")
    if file is not None:
        return file
    if not sys.stdin.isatty():
        return "-"
    ctx = typer.get_current_context()
    typer.echo(ctx.get_help(), err=True)
    raise typer.Exit(2)


def read_input(source: str, quiet: bool = False) -> str:
    """The document; on a terminal's stderr, a line when the input keeps us waiting (a FIFO
    nobody writes to, stdin from the keyboard)."""
    timer = None
    if not quiet and stderr.is_terminal:
        label = "stdin" if source == "-" else source
        timer = threading.Timer(WAIT_NOTICE_S, lambda: stderr.print(
            f"icecache: waiting for input on {label} (nothing written to it yet) ...",
            markup=False, soft_wrap=True))
        timer.daemon = True
        timer.start()
    try:
        return read_document(source)
    finally:
        if timer is not None:
            timer.cancel()


def set_threads(threads: int, reporter: Reporter) -> None:
    import torch

    # the cores this process may run on (taskset, a container's CPU set), not the machine's
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:
        reporter.warn(f"profile asks for {threads} CPU threads, this machine has {cores}; using {cores}")
    torch.set_num_threads(min(threads, cores) if threads else cores)


def check_budget_flag(budget: int | None, method: str, quiet: bool) -> None:
    """``--budget`` with a method that has none: said once on stderr (the run reports none)."""
    if budget is not None and not get(method).budgeted and not quiet:
        warn(f"--budget {budget} has no effect with --method {method} (it selects no pages); "
             "the result reports no budget")


def preflight(opts: RunOptions, max_new: int, log: Callable[[str], None]):
    """The checks that need no model loaded: ``(settings, resolved model source)``."""
    settings = resolve_settings(opts.profile, **opts.flags())
    check_device(settings)
    get(opts.method)
    check_prefill(opts.method, settings)
    check_generation_room(max_new, settings.max_context, f"max_context of the {settings.name} profile")
    resolved = resolve_model_source(opts.model, log)  # a .gguf that is not one fails here
    trained = context_length_of(resolved[1])
    check_generation_room(max_new, context_limit(settings, trained, opts.method), resolved[0])
    return settings, resolved


def run_task(
    task: str,
    file: str | None,
    opts: RunOptions,
    max_new: int,
    job: Callable[[Runner, str, Reporter], TaskResult],
    segments: list[str] | None = None,
    questions: list[str] | None = None,
) -> None:
    """Shared flow: check everything that needs no model, load it, run, print.

    On a terminal, a live panel on stderr. The text streams to stdout as it is generated unless
    stdout is the panel's own terminal: there it shows inside the panel and is printed whole at
    the end. ``--json`` prints one object at the end.
    """
    quiet, as_json, method = opts.quiet, opts.as_json, opts.method
    with user_errors():
        source = _input_source(file)
        if questions is not None:
            check_questions(questions)
        settings, resolved = preflight(opts, max_new, log=lambda m: None if quiet else stderr.print(
            m, style="dim", markup=False, soft_wrap=True))
        check_budget_flag(opts.budget, method, quiet)
        text = read_input(source, quiet)
    panel = not quiet and panel_capable()
    inside = panel and same_terminal(1, 2)
    stream_out = not as_json and not inside
    title = f"icecache {task} ({method})"
    with user_errors(), Reporter(quiet, panel=title if panel else None,
                                 show_text=inside and not as_json) as reporter:
        set_threads(settings.cpu_threads, reporter)
        loaded = load_model(opts.model, settings, log=reporter.info, resolved=resolved)
        reporter.info(f"model ready in {loaded.load_seconds:.1f} s ({settings.name} profile, {settings.device}, {settings.dtype})")
        from icecache.tasks import Runner

        runner = Runner(loaded, settings, method)
        runner.warn = reporter.warn
        runner.note = reporter.info
        runner.budget_flag = opts.budget
        stream = _hook_tokens(runner, reporter, loaded.tokenizer, max_new, segments,
                              out=write_out if stream_out else None, inside=inside and not as_json)
        reporter.phase("prefill")
        result = job(runner, text, reporter)
        if stream_out:
            stream.finish(f"\nAnswer: {result.answer}\n" if result.task == "cot" else "\n")
        reporter.finish()
        _report(reporter, runner, result, settings, method)
        if opts.stats:
            print_stats_line(final_stats(result, runner.session.cache, settings, runner.session,
                                         weights=loaded.weights, template=loaded.template), as_json)
    if as_json:
        emit(json.dumps(result.to_json(), ensure_ascii=False))
    elif not stream_out:
        emit(render_text(result))


def _hook_tokens(runner: Runner, reporter: Reporter, tok, max_new: int, segments, out, inside: bool):
    """Each new token goes to the streamed text (``out``, or the panel when ``inside``) and the
    panel's figures. Returns the stream (None when the text is printed at the end)."""
    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    stream = None
    if out is not None:
        stream = TextStream(decode, out, segments)
    elif inside:
        def into_panel(part: str) -> None:
            reporter.panel.text += part

        stream = TextStream(decode, into_panel, segments)
    if reporter.panel is not None:
        reporter.memory_probe = lambda: memory_now(runner.session.cache)
    if stream is None and reporter.panel is None:
        return None

    def on_token(tokens, stats) -> None:
        if stream is not None:
            stream.tokens_now(tokens)
        reporter.token(tokens, max_new, stats.step_seconds, runner.session.cache)

    runner.session.on_token = on_token
    return stream


def _report(reporter: Reporter, runner: Runner, result: TaskResult, settings: Settings, method: str) -> None:
    """The run's figures as status lines on stderr (and into ``result.memory``)."""
    stats = getattr(runner.session.cache, "stats", None)
    if stats is not None and stats.steps:
        d = stats.as_dict()
        reporter.info(
            f"{method}: {d['pages_loaded_per_step']:.0f} of {d['pages_selected_per_step']:.0f} pages "
            f"loaded per step ({d['bytes_moved_per_step'] / 2**20:.2f} MiB); index query "
            f"{d['query_ms_per_step']:.1f} ms, loading {d['load_ms_per_step']:.1f} ms, attention "
            f"{d['attention_ms_per_step']:.1f} ms per step; index built in {d['index_build_s']:.2f} s")
    for s in result.stats:
        rate = s.tokens_prefilled / s.prefill_seconds if s.prefill_seconds else 0.0
        reporter.info(
            f"prompt {s.tokens_in} tokens ({s.tokens_prefilled} computed) in {s.prefill_seconds:.2f} s "
            f"({rate:.0f} tokens/s, {settings.prefill} prefill); "
            f"{s.decode_line()}"
        )
    mem = memory_figures(runner.session.cache)
    result.memory = mem
    windows = (f" ({mem['window_layers']} sliding-window layers {mem['window_kv_bytes'] / 2**20:.1f} MiB of it, "
               "each its window only)") if mem["window_layers"] else ""
    reporter.info(
        f"memory: peak RSS {mem['peak_rss_bytes'] / 2**30:.2f} GiB; resident KV "
        f"{mem['device_kv_bytes'] / 2**20:.1f} MiB{windows}, host store {mem['host_kv_bytes'] / 2**20:.1f} MiB")


def final_stats(result: TaskResult, cache, settings, session=None, weights: str | None = None,
                template: str | None = None) -> dict:
    """The run's figures for ``--stats``: prompt, prefill speed, per-token latency, memory."""
    steps = [1000 * t for s in result.stats for t in s.step_seconds]
    steps.sort()
    pre_s = sum(s.prefill_seconds for s in result.stats)
    pre_tok = sum(s.tokens_prefilled for s in result.stats)
    out = {
        "method": result.method,
        "prefill": session.prefill_mode if session is not None else settings.prefill,
        "positions": session.positions if session is not None else None,
        "all_dense": session.all_dense if session is not None else None,
        "rope_scaling": settings.rope_scaling,
        "weights": weights or settings.weights,
        "template": template,  # the prompts' chat template: own, a family's (icecache.chat), plain
        "prompt_tokens": result.tokens_in,
        "prefix_cached_tokens": sum(s.prefix_cached_tokens for s in result.stats),
        "prefill_s": round(pre_s, 3),
        "prefill_tok_s": round(pre_tok / pre_s, 1) if pre_s else None,
        "new_tokens": result.tokens_out,
        "tpot_ms": round(steps[len(steps) // 2], 2) if steps else None,
        "tpot_p90_ms": round(steps[min(len(steps) - 1, int(0.9 * len(steps)))], 2) if steps else None,
        "tpot_mean_ms": round(sum(steps) / len(steps), 2) if steps else None,
        "seconds": round(result.seconds, 3),
        **(result.memory or {}),
    }
    st = getattr(cache, "stats", None)
    if st is not None and getattr(st, "steps", 0):
        d = st.as_dict()
        for k in ("pages_selected_per_step", "pages_loaded_per_step", "query_ms_per_step",
                  "load_ms_per_step", "attention_ms_per_step"):
            out[k] = round(d[k], 3)
    return out


def print_stats_line(stats: dict, as_json: bool) -> None:
    """One line on stderr (even with --quiet: it was asked for)."""
    from .output import stderr

    if as_json:
        line = json.dumps(stats)
    else:
        line = "stats: " + " ".join(f"{k}={v}" for k, v in stats.items() if v is not None)
    stderr.print(line, markup=False, highlight=False, soft_wrap=True)


def memory_figures(cache) -> dict:
    """Peak process RSS and the cache's resident (device pool + dense layers) and host bytes."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    dev, host, _ = kv_bytes(cache)
    layers, window = window_kv(cache)
    return {"peak_rss_bytes": int(peak), "device_kv_bytes": dev, "host_kv_bytes": host,
            "window_layers": layers, "window_kv_bytes": window}


def render_text(result: TaskResult) -> str:
    if result.task == "qa":
        if len(result.output) == 1:
            return result.output[0]
        return "\n\n".join(f"Q: {q}\nA: {a}" for q, a in zip(result.questions, result.output, strict=True))
    if result.task == "cot":
        return f"{result.output}\nAnswer: {result.answer}"
    return result.output


@with_options("opts", RunOptions)
def summarize(
    file: FileArg = None,
    max_new_tokens: max_new_opt() = 256,
    repetition_penalty: penalty_opt() = SUMMARY_REPETITION_PENALTY,
    opts: RunOptions = None,
) -> None:
    """Summarize a document."""
    run_task("summarize", file, opts, max_new_tokens,
             lambda r, text, rep: r.summarize(text, max_new_tokens, rep.progress, repetition_penalty))


@with_options("opts", RunOptions)
def qa(
    file: FileArg = None,
    question: Annotated[list[str], typer.Option("--question", "-q", help="A question about the document; repeat for several.")] = [],  # noqa: B006
    max_new_tokens: max_new_opt("Most tokens per answer.") = 64,
    repetition_penalty: penalty_opt() = 1.0,
    opts: RunOptions = None,
) -> None:
    """Answer questions about a document (the document is read once for all questions)."""
    # Streamed answers carry the same "Q: ... / A: ..." layout as the final output.
    segments = [("\n\n" if i else "") + f"Q: {q}\nA: " for i, q in enumerate(question)] if len(question) > 1 else None
    run_task("qa", file, opts, max_new_tokens,
             lambda r, text, rep: r.qa(text, list(question), max_new_tokens, rep.progress, repetition_penalty),
             segments=segments, questions=list(question))


@with_options("opts", RunOptions)
def cot(
    file: FileArg = None,
    max_new_tokens: max_new_opt() = 512,
    repetition_penalty: penalty_opt() = 1.0,
    opts: RunOptions = None,
) -> None:
    """Reason step by step over a problem; the last line is the extracted final answer."""
    run_task("cot", file, opts, max_new_tokens,
             lambda r, text, rep: r.cot(text, max_new_tokens, rep.progress, repetition_penalty))
