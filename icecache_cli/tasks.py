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

from .output import Reporter, emit, user_errors

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
) -> None:
    """Shared flow: validate settings, read the input, load the model, run, print."""
    with user_errors(), Reporter(quiet) as reporter:
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
        result = job(runner, text, reporter)
        reporter.close()
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
    if as_json:
        emit(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        emit(render_text(result))


def memory_figures(cache) -> dict:
    """Peak process RSS and the cache's resident (device pool + dense layers) and host bytes."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    dev = host = 0
    if cache is not None and hasattr(cache, "device_kv_bytes"):
        dev = cache.device_kv_bytes()
        host = cache.host_kv_bytes() if hasattr(cache, "host_kv_bytes") else 0
    elif cache is not None:
        dev = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers
                  if getattr(layer, "keys", None) is not None)
    return {"peak_rss_bytes": int(peak), "device_kv_bytes": int(dev), "host_kv_bytes": int(host)}


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
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document."""
    run_task(file, model, profile, method, budget, as_json, quiet,
             lambda r, text, rep: r.summarize(text, max_new_tokens, rep.progress, repetition_penalty),
             flags=dict(reuse_every=reuse_every, prefill=prefill, chunk_size=chunk_size, pipeline=pipeline))


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
    quiet: QuietOpt = False,
) -> None:
    """Answer questions about a document (the document is read once for all questions)."""
    if not question:
        raise typer.BadParameter("give at least one question with -q/--question", param_hint="'-q'")
    run_task(file, model, profile, method, budget, as_json, quiet,
             lambda r, text, rep: r.qa(text, list(question), max_new_tokens, rep.progress, repetition_penalty),
             flags=dict(reuse_every=reuse_every, prefill=prefill, chunk_size=chunk_size, pipeline=pipeline))


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
    quiet: QuietOpt = False,
) -> None:
    """Reason step by step over a problem; the last line is the extracted final answer."""
    run_task(file, model, profile, method, budget, as_json, quiet,
             lambda r, text, rep: r.cot(text, max_new_tokens, rep.progress, repetition_penalty),
             flags=dict(reuse_every=reuse_every, prefill=prefill, chunk_size=chunk_size, pipeline=pipeline))
