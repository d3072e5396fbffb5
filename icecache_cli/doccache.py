"""``icecache prefill FILE...`` (fill the document cache) and ``icecache cache list|clear``."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Annotated

import typer

from icecache.config import resolve_settings
from icecache.doc_cache import MANIFEST, default_root, list_entries

from .options import DocCacheOpt, RunOptions, with_options
from .output import emit, stderr, user_errors

cache_app = typer.Typer(help="The document cache: saved prefills of documents (docs/usage.md).",
                        no_args_is_help=True)

ProfileOpt = Annotated[str | None, typer.Option("--profile", "-p", show_default=False,
                                                help="Hardware profile (its doc_cache folder).")]


def cache_root(doc_cache: str | None, profile: str | None) -> Path:
    where = doc_cache if doc_cache is not None else resolve_settings(profile).doc_cache
    if where == "off":
        raise typer.BadParameter("the document cache is off (doc_cache: off)", param_hint="--doc-cache")
    return Path(where).expanduser() if where else default_root()


def _describe(path: Path, size: int, used: float) -> dict:
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        m = {}
    kind = m.get("identity", {}).get("kind")
    return {"entry": path.name, "tokens": m.get("tokens"), "bytes": size,
            "kind": f"sparse state ({kind.get('method')})" if isinstance(kind, dict) else "full prefill KV",
            "model": m.get("identity", {}).get("source"), "last_used": round(used, 1)}


@cache_app.command("list")
def list_cmd(doc_cache: DocCacheOpt = None, profile: ProfileOpt = None,
             as_json: Annotated[bool, typer.Option("--json", help="One JSON object per entry.")] = False) -> None:
    """The saved documents, least recently used first, and their total size."""
    with user_errors():
        root = cache_root(doc_cache, profile)
        rows = [_describe(*e) for e in list_entries(root)]
    for r in rows:
        if as_json:
            emit(json.dumps(r))
        else:
            age = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["last_used"]))
            emit(f"{r['entry']}  {r['tokens']} tokens  {r['bytes'] / 2**20:.1f} MiB  {r['kind']}  used {age}")
    total = sum(r["bytes"] for r in rows)
    stderr.print(f"{len(rows)} entries, {total / 2**20:.1f} MiB in {root}", markup=False, soft_wrap=True)


@cache_app.command("clear")
def clear_cmd(doc_cache: DocCacheOpt = None, profile: ProfileOpt = None,
              older_than: Annotated[float | None, typer.Option(
                  "--older-than", metavar="DAYS", min=0, show_default=False,
                  help="Only entries not used for this many days.")] = None) -> None:
    """Remove saved documents (all, or those not used for --older-than days)."""
    with user_errors():
        root = cache_root(doc_cache, profile)
        now, removed, freed = time.time(), 0, 0
        for path, size, used in list_entries(root):
            if older_than is None or now - used > older_than * 86400:
                shutil.rmtree(path, ignore_errors=True)
                removed, freed = removed + 1, freed + size
        if older_than is None and root.is_dir():  # unfinished saves and the lengths index too
            for p in root.iterdir():
                if p.name.startswith(".saving-"):
                    shutil.rmtree(p, ignore_errors=True)
    stderr.print(f"removed {removed} entries, {freed / 2**20:.1f} MiB", markup=False, soft_wrap=True)


@with_options("opts", RunOptions)
def prefill(
    files: Annotated[list[str], typer.Argument(metavar="FILE...", help="Documents to prefill into the document cache.")],
    opts: RunOptions = None,
) -> None:
    """Prefill documents into the document cache without generating: a later summarize or qa
    over them starts from there. One line per file on stdout (JSON with --json)."""
    from icecache.models import load_model
    from icecache.tasks import Runner

    from .output import Reporter
    from .tasks import preflight, read_input, set_threads

    quiet = opts.quiet
    with user_errors():
        if opts.no_doc_cache:
            raise typer.BadParameter("prefill fills the document cache: drop --no-doc-cache", param_hint="--no-doc-cache")
        settings, resolved = preflight(opts, 1, log=lambda m: None if quiet else stderr.print(m, style="dim", markup=False))
        if settings.doc_cache == "off":
            raise typer.BadParameter("the document cache is off (doc_cache: off)", param_hint="--doc-cache")
        texts = [(f, read_input(f, quiet)) for f in files]
    with user_errors(), Reporter(quiet, panel=None) as reporter:
        set_threads(settings.cpu_threads, reporter)
        loaded = load_model(opts.model, settings, log=reporter.info, resolved=resolved)
        runner = Runner(loaded, settings, opts.method)
        runner.warn = reporter.warn
        for name, text in texts:
            t0 = time.perf_counter()
            stats = runner.prefill_document(text, reporter.progress)
            cached = stats.prefix_cached_tokens
            state = "already cached" if cached else ("saved" if runner.session.doc_cache.find(
                runner.session.cached_ids, len(runner.session.cached_ids)) else "not cached")
            row = {"file": name, "prompt_tokens": stats.tokens_in, "status": state,
                   "seconds": round(time.perf_counter() - t0, 2)}
            if state == "not cached":
                row["reason"] = f"fewer than {settings.doc_cache_min_tokens} document tokens, or a method or prefill the cache does not keep"
            emit(json.dumps(row) if opts.as_json else f"{name}\t{stats.tokens_in} tokens\t{state}\t{row['seconds']} s")
