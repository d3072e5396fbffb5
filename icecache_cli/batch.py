"""``icecache batch``: many documents, one model load, one JSON line per result."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from icecache.config import resolve_settings
from icecache.errors import IceCacheError, UsageError

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
) -> None:
    """Process many documents; exit 0 if all succeeded, 3 if some failed (see their records)."""
    from icecache import batch as b
    from icecache.documents import decode_text
    from icecache.methods import get
    from icecache.models import context_length_of, load_model, resolve_model_source
    from icecache.tasks import Runner, check_generation_room, check_questions, context_limit

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
        set_threads(settings.cpu_threads, rep)
        loaded = load_model(model, settings, log=rep.info, resolved=resolved)
        runner = Runner(loaded, settings, method)
        failed = failed_before = done = skipped = 0
        t0 = time.perf_counter()
        try:
            for n, path in enumerate(inputs, 1):
                try:
                    data = Path(path).read_bytes()
                    digest = b.content_hash(data)
                except OSError as exc:
                    data, digest = None, None
                    read_error = f"{path}: cannot be read ({exc.strerror or exc})"
                keys = {q: (b.resolved(path), digest, task, q) for q in questions}
                todo = [q for q in questions if keys[q] not in results.done]
                if not todo:
                    skipped += 1
                    failed_before += any(k in results.failed for k in keys.values())
                    continue
                for q in todo:
                    rec = {"path": path, "hash": digest, "task": task, "question": q, "output": None,
                           "tokens_in": 0, "tokens_out": 0, "seconds": 0.0, "method": method,
                           "budget": settings.budget if budgeted else None, "error": None}
                    t_doc = time.perf_counter()
                    try:
                        if data is None:
                            raise IceCacheError(read_error)
                        text = decode_text(data, path)
                        if task == "summarize":
                            r = runner.summarize(text, max_new_tokens)
                        elif task == "cot":
                            r = runner.cot(text, max_new_tokens)
                        else:
                            r = runner.qa(text, [q], max_new_tokens)
                        out_text = r.output[0] if task == "qa" else r.output
                        rec.update(output=out_text, tokens_in=r.tokens_in, tokens_out=r.tokens_out)
                        if task == "cot":
                            rec["answer"] = r.answer
                    except IceCacheError as exc:
                        rec["error"] = str(exc)
                    rec["seconds"] = round(time.perf_counter() - t_doc, 3)
                    try:
                        results.write(rec, sys.stdout)
                    except BrokenPipeError:  # `| head`: the reader has what it wanted
                        silence_stdout()
                        raise typer.Exit(0) from None
                    failed += rec["error"] is not None
                done += 1
                if not quiet:
                    rate = done / max(1e-9, time.perf_counter() - t0) * 60
                    left = (len(inputs) - n) / max(rate, 1e-9)
                    rep.info(f"[{n}/{len(inputs)}] {path}: {'failed' if rec['error'] else 'ok'}; "
                             f"{failed} failed, {rate:.1f} documents/min, ETA {left:.1f} min")
        finally:  # Ctrl-C and SIGTERM (icecache_cli.app) leave complete lines behind
            results.close()
        if skipped:
            rep.info(f"{skipped} documents already done in {out}, skipped"
                     + (f" ({failed_before} of them have only error records)" if failed_before else ""))
        if failed or failed_before:
            raise typer.Exit(b.EXIT_SOME_FAILED)
