"""``icecache batch``: many documents, one model load, one JSON line per result."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from icecache.config import resolve_settings
from icecache.errors import IceCacheError, UsageError

from .output import Reporter, silence_stdout, user_errors
from .tasks import _set_threads


class Terminated(Exception):
    """SIGTERM arrived: stop after the current write, like Ctrl-C."""


def _on_term(signum, frame):
    raise Terminated()


def batch(
    paths: Annotated[list[str], typer.Argument(help="Files, folders (searched recursively) or - for a list of paths on stdin.", show_default=False)],
    task: Annotated[str, typer.Option("--task", help="summarize, qa or cot.")] = "summarize",
    question: Annotated[list[str], typer.Option("--question", "-q", help="qa: a question; repeat for several (one record per question).")] = [],  # noqa: B006
    glob: Annotated[str, typer.Option("--glob", help="Files to take from folders.")] = "*.txt",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="JSONL results file (appended; a rerun skips what is done). Default: stdout.", show_default=False)] = None,
    shard: Annotated[str | None, typer.Option("--shard", help="I/N: process only this machine's share of the inputs.", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Most tokens per output.")] = 256,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (default: the embedded one).", show_default=False)] = None,
    profile: Annotated[str | None, typer.Option("--profile", "-p", help="Hardware profile.", show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", help="KV-cache method.")] = "full",
    budget: Annotated[int | None, typer.Option("--budget", help="Budget in tokens.", show_default=False)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="Nothing on stderr but errors.")] = False,
) -> None:
    """Process many documents; exit 0 if all succeeded, 3 if some failed (see their records)."""
    from icecache import batch as b
    from icecache.documents import decode_text
    from icecache.methods import check_method
    from icecache.models import load_model
    from icecache.tasks import Runner

    with user_errors(), Reporter(quiet) as rep:
        if task not in ("summarize", "qa", "cot"):
            raise UsageError(f"--task: '{task}' is not one of summarize, qa, cot")
        if task == "qa" and not question:
            raise UsageError("--task qa needs at least one -q QUESTION")
        if task != "qa" and question:
            raise UsageError("-q/--question only goes with --task qa")
        which = b.parse_shard(shard)
        settings = resolve_settings(profile, budget=budget)
        check_method(method)
        stdin_lines = sys.stdin if "-" in paths else None
        inputs = [p for p in b.list_inputs(paths, glob, stdin_lines) if b.in_shard(p, which)]
        results = b.ResultsFile(out)
        questions = question if task == "qa" else [None]
        _set_threads(settings.cpu_threads, rep)
        loaded = load_model(model, settings, log=rep.info)
        runner = Runner(loaded, settings, method)
        previous = signal.signal(signal.SIGTERM, _on_term)
        failed = done = skipped = 0
        t0 = time.perf_counter()
        try:
            for n, path in enumerate(inputs, 1):
                try:
                    data = Path(path).read_bytes()
                    digest = b.content_hash(data)
                except OSError as exc:
                    data, digest = None, None
                    read_error = f"{path}: cannot be read ({exc.strerror or exc})"
                todo = [q for q in questions
                        if (path, digest, task, q) not in results.done]
                if not todo:
                    skipped += 1
                    continue
                for q in todo:
                    rec = {"path": path, "hash": digest, "task": task, "question": q, "output": None,
                           "tokens_in": 0, "tokens_out": 0, "seconds": 0.0, "method": method,
                           "budget": settings.budget, "error": None}
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
        except Terminated:
            rep.info("terminated: the results written so far are complete lines")
            raise typer.Exit(143) from None
        finally:
            signal.signal(signal.SIGTERM, previous)
            results.close()
        if skipped:
            rep.info(f"{skipped} documents already done in {out}, skipped")
        if failed:
            raise typer.Exit(b.EXIT_SOME_FAILED)
