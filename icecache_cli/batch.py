"""``icecache batch``: many documents, one model load, one JSON line per result."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from icecache.config import resolve_settings
from icecache.errors import UsageError

from .options import BudgetOpt, MethodOpt, ModelOpt, ProfileOpt, QuietOpt, max_new_opt
from .output import Reporter, silence_stdout, user_errors


def batch(
    paths: Annotated[list[str], typer.Argument(help="Files, folders (searched recursively) or - for a list of paths on stdin.", show_default=False)],
    task: Annotated[str, typer.Option("--task", help="summarize, qa or cot.")] = "summarize",
    question: Annotated[list[str], typer.Option("--question", "-q", help="qa: a question; repeat for several (one record per question).")] = [],  # noqa: B006
    glob: Annotated[str, typer.Option("--glob", help="Files to take from folders.")] = "*.txt",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="JSONL results file (appended; a rerun skips what is done). Default: stdout.", show_default=False)] = None,
    shard: Annotated[str | None, typer.Option("--shard", help="I/N: process only this machine's share of the inputs.", show_default=False)] = None,
    max_new_tokens: max_new_opt("Most tokens per output.") = 256,
    model: ModelOpt = None,
    profile: ProfileOpt = None,
    method: MethodOpt = "ice",
    budget: BudgetOpt = None,
    quiet: QuietOpt = False,
    engine: Annotated[str, typer.Option("--engine", help="local (this process) or ray (an actor pool on a Ray cluster; pip install 'icecache\\[ray]').")] = "local",
    address: Annotated[str | None, typer.Option("--address", help="ray: the cluster to join (default: Ray's own, RAY_ADDRESS or a local instance).", show_default=False)] = None,
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="ray: actors, each loading the model once (default: the cluster's CPUs / --cpus-per-worker).", show_default=False)] = None,
    cpus_per_worker: Annotated[int, typer.Option("--cpus-per-worker", min=1, help="ray: CPUs (torch threads) per actor.")] = 1,
    gpus_per_worker: Annotated[float, typer.Option("--gpus-per-worker", min=0.0, help="ray: GPUs per actor (GPU profiles).")] = 0.0,
) -> None:
    """Process many documents; exit 0 if all succeeded, 3 if some failed (see their records)."""
    from icecache import batch as b
    from icecache.checks import check_generation_room, check_questions, context_limit
    from icecache.methods import get
    from icecache.models import context_length_of, load_model, resolve_model_source

    from .tasks import check_budget_flag, set_threads

    with user_errors(), Reporter(quiet) as rep:
        if task not in ("summarize", "qa", "cot"):
            raise UsageError(f"--task: '{task}' is not one of summarize, qa, cot")
        if task == "qa":
            if not question:
                raise UsageError("--task qa needs at least one -q QUESTION")
            check_questions(question)
        if task != "qa" and question:
            raise UsageError("-q/--question only goes with --task qa")
        which = b.parse_shard(shard)
        settings = resolve_settings(profile, budget=budget)
        if engine not in ("local", "ray"):
            raise UsageError(f"--engine: '{engine}' is not one of local, ray")
        if engine == "local":
            given = [flag for flag, value in (("--address", address), ("--workers", workers),
                                              ("--cpus-per-worker", cpus_per_worker != 1),
                                              ("--gpus-per-worker", gpus_per_worker != 0)) if value]
            if given:
                raise UsageError(f"{', '.join(given)} only go with --engine ray")
        else:
            from icecache.batch_ray import check_ray

            check_ray(settings, gpus_per_worker)
        budgeted = get(method).budgeted
        check_budget_flag(budget, method, quiet)
        if "-" in paths and sys.stdin is None:
            raise UsageError("'-' reads paths from stdin, but stdin is closed")
        stdin_lines = sys.stdin if "-" in paths else None
        inputs = [p for p in b.list_inputs(paths, glob, stdin_lines) if b.in_shard(p, which)]
        results = b.ResultsFile(out)
        questions = question if task == "qa" else [None]
        resolved = resolve_model_source(model, rep.info)  # the generation room, before loading
        check_generation_room(max_new_tokens, context_limit(settings, context_length_of(resolved[1]), method), resolved[0])
        budget_value = settings.budget if budgeted else None
        if engine == "ray":  # the actors load the model, each once
            from icecache.batch_ray import RayOptions, run_ray

            try:
                tally = run_ray(inputs, task, questions, results, RayOptions(
                    address=address, workers=workers, cpus_per_worker=cpus_per_worker,
                    gpus_per_worker=gpus_per_worker, model=model, settings=settings, method=method,
                    budget=budget_value, max_new_tokens=max_new_tokens), rep, quiet)
            except BrokenPipeError:  # `| head`: the reader has what it wanted
                silence_stdout()
                raise typer.Exit(0) from None
            failed, failed_before, skipped = tally.failed, tally.failed_before, tally.skipped
        else:
            from icecache.tasks import Runner

            set_threads(settings.cpu_threads, rep)
            loaded = load_model(model, settings, log=rep.info, resolved=resolved)
            failed, failed_before, skipped = _run_local(
                inputs, task, questions, results, Runner(loaded, settings, method), method,
                budget_value, max_new_tokens, rep, quiet)
        if skipped:
            rep.info(f"{skipped} documents already done in {out or 'the output'}, skipped"
                     + (f" ({failed_before} of them have only error records)" if failed_before else ""))
        if failed or failed_before:
            raise typer.Exit(b.EXIT_SOME_FAILED)


def _run_local(inputs, task, questions, results, runner, method, budget, max_new_tokens, rep,
               quiet) -> tuple[int, int, int]:
    """The documents one after another in this process; returns (failed, failed before, skipped)."""
    from icecache import batch as b

    failed = failed_before = done = skipped = 0
    t0 = time.perf_counter()

    def emit(rec: dict) -> None:
        nonlocal failed
        try:
            results.write(rec, sys.stdout)
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            silence_stdout()
            raise typer.Exit(0) from None
        failed += rec["error"] is not None

    try:
        for n, path in enumerate(inputs, 1):
            data, digest, read_error = b.read_input(path)
            todo = b.pending(results, path, digest, task, questions)
            if not todo:
                skipped += 1
                failed_before += b.only_errors(results, path, digest, task, questions)
                continue
            recs = b.run_job(runner, b.Job(path, digest, todo), data, read_error, task, max_new_tokens,
                             method, budget, emit=emit)
            done += 1
            if not quiet:
                rate = done / max(1e-9, time.perf_counter() - t0) * 60
                left = (len(inputs) - n) / max(rate, 1e-9)
                rep.info(f"[{n}/{len(inputs)}] {path}: {'failed' if recs[-1]['error'] else 'ok'}; "
                         f"{failed} failed, {rate:.1f} documents/min, ETA {left:.1f} min")
    finally:  # Ctrl-C and SIGTERM (icecache_cli.app) leave complete lines behind
        results.close()
    return failed, failed_before, skipped
