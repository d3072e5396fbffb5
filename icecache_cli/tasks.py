"""``icecache summarize``, ``icecache qa`` and ``icecache cot``: one document in, text out."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from icecache.config import resolve_settings
from icecache.documents import read_document
from icecache.methods import check_method, check_prefill
from icecache.models import check_device, load_model
from icecache.tasks import SUMMARY_REPETITION_PENALTY, Runner, TaskResult

from .live import TextStream, cache_kv_bytes, memory_now, same_terminal
from .output import Reporter, emit, panel_capable, user_errors, write_out

FileArg = Annotated[
    str | None,
    typer.Argument(metavar="FILE", help="Document to read; '-' (or a pipe and no FILE) reads stdin.", show_default=False),
]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="HF model id (local cache), model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.", show_default=False),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option("--profile", "-p", help="Hardware profile name (see `icecache profiles`) or YAML path. Default: cpu without CUDA.", show_default=False),
]
MethodOpt = Annotated[str, typer.Option("--method", help="KV-cache method: full, ice, ice-reuse, streaming, oracle.")]
BudgetOpt = Annotated[
    int | None,
    typer.Option("--budget", help="Tokens of selected KV pages per head (a multiple of the page size). Default: the profile's.", show_default=False),
]
ReuseOpt = Annotated[
    int | None,
    typer.Option("--reuse-every", min=1, help="ice-reuse: one layer in N queries its index, the next N-1 reuse its pages. Default: the profile's (3).", show_default=False),
]
PrefillOpt = Annotated[
    str | None,
    typer.Option("--prefill", help="full: each chunk attends to everything before it; sparse: to the sink, the pages the index selects and a window (memory and time grow linearly; ice, ice-reuse, streaming, quest). Default: the profile's (full).", show_default=False),
]
ChunkOpt = Annotated[
    int | None,
    typer.Option("--chunk-size", min=1, help="Prompt tokens per prefill chunk (a multiple of the page size). Default: the profile's.", show_default=False),
]
PipelineOpt = Annotated[
    bool | None,
    typer.Option("--pipeline/--no-pipeline", help="Offload and index each layer in the background while the next computes. Default: the profile's (on).", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
StatsOpt = Annotated[bool, typer.Option("--stats", help="Print the final figures (prefill, per-token latency, memory, pages) as one line on stderr; JSON with --json.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="Nothing on stderr but errors.")]


def _penalty_opt(default: float):
    return Annotated[float, typer.Option("--repetition-penalty", min=1.0, max=2.0,
                                         help="Penalty on repeating tokens already generated (1 = none).")]


def _input_source(file: str | None) -> str:
    """FILE, or stdin when piped; a terminal with no FILE prints help."""
    if file is not None:
        return file
    if not sys.stdin.isatty():
        return "-"
    ctx = typer.get_current_context()
    typer.echo(ctx.get_help(), err=True)
    raise typer.Exit(2)


def _set_threads(threads: int, reporter: Reporter) -> None:
    import torch

    cores = os.cpu_count() or 1
    if threads > cores:
        reporter.warn(f"profile asks for {threads} CPU threads, this machine has {cores}; using {cores}")
    torch.set_num_threads(min(threads, cores) if threads else cores)


def run_task(
    file: str | None,
    model: str | None,
    profile: str | None,
    method: str,
    budget: int | None,
    as_json: bool,
    quiet: bool,
    job: Callable[[Runner, str, Reporter], TaskResult],
    flags: dict | None = None,
    max_new: int = 0,
    stats_line: bool = False,
    task: str = "run",
    segments: list[str] | None = None,
) -> None:
    """Shared flow: validate settings, read the input, load the model, run, print.

    On a terminal, a live panel on stderr. The text then streams to stdout as it is generated
    when stdout is not that terminal (a pipe, a file, another terminal); on the same terminal it
    shows inside the panel and is printed whole at the end.
    """
    panel = not quiet and panel_capable()
    inside = panel and same_terminal(1, 2)
    stream_out = panel and not inside and not as_json
    streamed = False
    title = f"icecache {task} ({method})"
    with user_errors(), Reporter(quiet, panel=title if panel else None,
                                 show_text=inside and not as_json) as reporter:
        source = _input_source(file)
        settings = resolve_settings(profile, budget=budget, **(flags or {}))
        check_device(settings)
        check_method(method)
        check_prefill(method, settings)
        text = read_document(source)
        _set_threads(settings.cpu_threads, reporter)
        loaded = load_model(model, settings, log=reporter.info)
        reporter.info(f"model ready in {loaded.load_seconds:.1f} s ({settings.name} profile, {settings.device}, {settings.dtype})")
        runner = Runner(loaded, settings, method)
        runner.warn = reporter.warn
        stream = None
        if panel:
            tok = loaded.tokenizer

            def decode(ids: list[int]) -> str:
                return tok.decode(ids, skip_special_tokens=True)

            if stream_out:
                stream = TextStream(decode, write_out, segments)
            elif inside and not as_json:
                def into_panel(part: str) -> None:
                    reporter.panel.text += part

                stream = TextStream(decode, into_panel, segments)
            reporter.memory_probe = lambda: memory_now(runner.session.cache)

            def on_token(tokens, stats) -> None:
                if stream is not None:
                    stream.tokens_now(tokens)
                reporter.token(tokens, max_new, stats.step_seconds, runner.session.cache)

            runner.session.on_token = on_token
        reporter.phase("prefill")
        result = job(runner, text, reporter)
        if stream_out:
            stream.finish(f"\nAnswer: {result.answer}\n" if result.task == "cot" else "\n")
            streamed = True
        reporter.finish()
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
                f"{s.tokens_out} new tokens at {s.ms_per_token:.1f} ms/token"
            )
        mem = memory_figures(runner.session.cache)
        result.memory = mem
        reporter.info(
            f"memory: peak RSS {mem['peak_rss_bytes'] / 2**30:.2f} GiB; resident KV "
            f"{mem['device_kv_bytes'] / 2**20:.1f} MiB, host store {mem['host_kv_bytes'] / 2**20:.1f} MiB")
        if stats_line:
            print_stats_line(final_stats(result, runner.session.cache, settings), as_json)
    if as_json:
        emit(json.dumps(result.to_json(), ensure_ascii=False))
    elif not streamed:
        emit(render_text(result))


def final_stats(result: TaskResult, cache, settings) -> dict:
    """The run's figures for ``--stats``: prompt, prefill speed, per-token latency, memory."""
    steps = [1000 * t for s in result.stats for t in s.step_seconds]
    steps.sort()
    pre_s = sum(s.prefill_seconds for s in result.stats)
    pre_tok = sum(s.tokens_prefilled for s in result.stats)
    out = {
        "method": result.method,
        "prompt_tokens": result.tokens_in,
        "prefill_s": round(pre_s, 3),
        "prefill_tok_s": round(pre_tok / pre_s, 1) if pre_s else None,
        "new_tokens": result.tokens_out,
        "tpot_ms": round(steps[len(steps) // 2], 2) if steps else None,
        "tpot_p90_ms": round(steps[min(len(steps) - 1, int(0.9 * len(steps)))], 2) if steps else None,
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
    dev, host = cache_kv_bytes(cache)
    return {"peak_rss_bytes": int(peak), "device_kv_bytes": dev, "host_kv_bytes": host}


def render_text(result: TaskResult) -> str:
    if result.task == "qa":
        if len(result.output) == 1:
            return result.output[0]
        return "\n\n".join(f"Q: {q}\nA: {a}" for q, a in zip(result.questions, result.output, strict=True))
    if result.task == "cot":
        return f"{result.output}\nAnswer: {result.answer}"
    return result.output


def summarize(
    file: FileArg = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Most tokens to generate.")] = 256,
    model: ModelOpt = None,
    profile: ProfileOpt = None,
    method: MethodOpt = "full",
    budget: BudgetOpt = None,
    reuse_every: ReuseOpt = None,
    prefill: PrefillOpt = None,
    chunk_size: ChunkOpt = None,
    pipeline: PipelineOpt = None,
    repetition_penalty: _penalty_opt(SUMMARY_REPETITION_PENALTY) = SUMMARY_REPETITION_PENALTY,
    as_json: JsonOpt = False,
    stats: StatsOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document."""
    run_task(file, model, profile, method, budget, as_json, quiet,
             lambda r, text, rep: r.summarize(text, max_new_tokens, rep.progress, repetition_penalty),
             flags=dict(reuse_every=reuse_every, prefill=prefill, chunk_size=chunk_size, pipeline=pipeline),
             max_new=max_new_tokens, stats_line=stats, task="summarize")


def qa(
    file: FileArg = None,
    question: Annotated[list[str], typer.Option("--question", "-q", help="A question about the document; repeat for several.")] = [],  # noqa: B006
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Most tokens per answer.")] = 64,
    model: ModelOpt = None,
    profile: ProfileOpt = None,
    method: MethodOpt = "full",
    budget: BudgetOpt = None,
    reuse_every: ReuseOpt = None,
    prefill: PrefillOpt = None,
    chunk_size: ChunkOpt = None,
    pipeline: PipelineOpt = None,
    repetition_penalty: _penalty_opt(1.0) = 1.0,
    as_json: JsonOpt = False,
    stats: StatsOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Answer questions about a document (the document is read once for all questions)."""
    if not question:
        raise typer.BadParameter("give at least one question with -q/--question", param_hint="'-q'")
    # Streamed answers carry the same "Q: ... / A: ..." layout as the final output.
    segments = [("\n\n" if i else "") + f"Q: {q}\nA: " for i, q in enumerate(question)] if len(question) > 1 else None
    run_task(file, model, profile, method, budget, as_json, quiet,
             lambda r, text, rep: r.qa(text, list(question), max_new_tokens, rep.progress, repetition_penalty),
             flags=dict(reuse_every=reuse_every, prefill=prefill, chunk_size=chunk_size, pipeline=pipeline),
             max_new=max_new_tokens, stats_line=stats, task="qa", segments=segments)


def cot(
    file: FileArg = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Most tokens to generate.")] = 512,
    model: ModelOpt = None,
    profile: ProfileOpt = None,
    method: MethodOpt = "full",
    budget: BudgetOpt = None,
    reuse_every: ReuseOpt = None,
    prefill: PrefillOpt = None,
    chunk_size: ChunkOpt = None,
    pipeline: PipelineOpt = None,
    repetition_penalty: _penalty_opt(1.0) = 1.0,
    as_json: JsonOpt = False,
    stats: StatsOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Reason step by step over a problem; the last line is the extracted final answer."""
    run_task(file, model, profile, method, budget, as_json, quiet,
             lambda r, text, rep: r.cot(text, max_new_tokens, rep.progress, repetition_penalty),
             flags=dict(reuse_every=reuse_every, prefill=prefill, chunk_size=chunk_size, pipeline=pipeline),
             max_new=max_new_tokens, stats_line=stats, task="cot")
