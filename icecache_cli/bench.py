"""``icecache bench``: measurements that print physical units and same-run ratios."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from icecache.bench import llama_cpp  # (light: the bench package imports torch only where a bench runs)
from icecache.config import resolve_settings
from icecache.errors import UsageError

from .options import BenchOptions, with_options
from .output import Reporter, emit, stderr, user_errors

bench_app = typer.Typer(
    help="Benchmarks (figures on stderr; --json: one JSON line on stdout). `icecache bench --ctx "
         "8k,32k --methods full,dense,ice` measures the methods end to end; the subcommands "
         "measure one part.",
    no_args_is_help=True, invoke_without_command=True)


@bench_app.callback()
@with_options("opts", BenchOptions)
def bench_main(
    context: typer.Context,
    ctx: Annotated[str | None, typer.Option("--ctx", help="Context lengths, comma-separated (8k = 8192).", show_default=False)] = None,
    methods: Annotated[str, typer.Option("--methods", help="Methods, comma-separated (ratios are to full and dense when present). llama.cpp: the same GGUF and tokens through llama-cpp-python, when it is installed.")] = "full,dense,ice,ice-reuse,quest",
    steps: Annotated[int, typer.Option("--decode-steps", min=1, help="Timed decode steps per method (after 2 warm-up steps).")] = 16,
    full_prefill_max: Annotated[str, typer.Option("--full-prefill-max", help="Longest context prefilled with full attention; longer ones use the ice sparse prefill and the other methods decode from its rebuilt KV.")] = "32k",
    max_seconds: Annotated[float | None, typer.Option("--max-seconds", min=0.0, help="A method whose decode step takes longer is reported as over the cap, and skipped.", show_default=False)] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Folder for config.json and results.jsonl (each row appended as soon as it is measured).", show_default=False)] = None,
    positions: Annotated[str | None, typer.Option("--positions", help="RoPE positions past the trained context: remap, true or auto; several comma-separated are each measured in this run (own prefill each), e.g. remap,true. Default: the profile's.", show_default=False)] = None,
    opts: BenchOptions = None,
) -> None:
    """End-to-end bench: TT2T, tokens/s, TPOT (median, p90, mean), breakdown and memory per method.

    A method whose memory need (estimated) exceeds what is available gets a skipped row instead
    of running. Each row is printed (stderr; with --json also as a JSON line on stdout) and
    appended to --out as soon as it is measured; with --json the last line holds all rows.
    """
    if context.invoked_subcommand is not None:
        return
    from icecache.methods import check_method
    from icecache.models import load_model

    quiet, as_json = opts.quiet, opts.as_json
    with user_errors():
        if ctx is None:
            raise UsageError("--ctx: give the context lengths to measure, e.g. --ctx 8k,32k (or a subcommand, see --help)")
        sizes = [parse_size(x) for x in ctx.split(",") if x.strip()]
        names = [m.strip() for m in methods.split(",") if m.strip()]
        method_list = [m if m == llama_cpp.NAME else check_method(m) for m in names]
        if not method_list:
            raise UsageError("--methods: give at least one method")
        gguf = check_llama_cpp(opts.model) if llama_cpp.NAME in method_list else None
        settings = resolve_settings(opts.profile, budget=opts.budget, weights=opts.weights)
        position_list = parse_positions(positions, settings)
        limit = parse_size(full_prefill_max)
        if out is not None:
            if out.exists() and not out.is_dir():
                raise UsageError(f"--out: {out} exists and is not a folder")
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps({
                "ctx": sizes, "methods": method_list, "decode_steps": steps, "full_prefill_max": limit,
                "max_seconds": max_seconds, "positions": position_list, "settings": settings.as_dict(),
                "model": opts.model or "embedded"}, indent=1))
    with user_errors(), Reporter(quiet, panel="icecache bench") as rep:
        from icecache.bench import full_bench

        loaded = load_model(opts.model, settings, log=rep.info)
        results = []
        from icecache.bench import floor as bandwidth

        floor = bandwidth.measure(loaded.model)
        rep.info(floor.line())
        from .live import memory_now

        def log(message: str) -> None:
            rep.info(message)
            rep.phase(message.rstrip(" .").replace(" tokens:", ":"))  # e.g. "ice at 131072: decoding"

        def on_step(done, total, times, session) -> None:
            rep.memory_probe = lambda: memory_now(session.cache)
            rep.step(done, total, times, session.cache)

        def on_row(row) -> None:
            """A row is kept the moment it is measured: a later method cannot lose it."""
            d = row.as_dict()
            if out is not None:
                with open(out / "results.jsonl", "a") as f:
                    f.write(json.dumps(d) + "\n")
            if as_json:
                emit(json.dumps(d))
            rep.info(row_line(row))

        for n in sizes:
            by_positions = {}
            for pos in position_list:
                if len(position_list) > 1:
                    log(f"positions {pos} at {n} tokens ...")
                rows = full_bench.run_ctx(loaded, settings.replace(positions=pos), method_list, n, steps=steps,
                                          full_prefill_max=limit, max_seconds=max_seconds, log=log,
                                          on_progress=lambda ph, d, t: rep.progress(ph, d, t) if ph == "prefill" else None,
                                          on_step=on_step, on_row=on_row, gguf=gguf)
                rep.close()
                results.extend(r.as_dict() for r in rows)
                by_positions[pos] = rows
                if not quiet:
                    print_bench_table(rows, n, f"positions {pos}" if len(position_list) > 1 else "")
            if not quiet:
                for line in floor_lines(results, n, floor.ms):
                    stderr.print(line, markup=False)
            if not quiet and llama_cpp.NAME in method_list:
                for line in llama_cpp_lines(results, n):
                    stderr.print(line, markup=False)
            if not quiet and len(position_list) > 1:
                for line in positions_ratios(by_positions):
                    stderr.print(line, markup=False)
        if as_json:
            emit(json.dumps({"results": results, "floor": floor.as_dict()}))


def check_llama_cpp(model: str | None) -> Path:
    """``--methods ...,llama.cpp``: the GGUF file it runs; a one-line error when llama-cpp-python
    is not installed, the model is not a GGUF file, or llama.cpp dies on this CPU."""
    why = llama_cpp.missing()
    if why is not None:
        raise UsageError(f"--methods {llama_cpp.NAME}: {why}")
    gguf = llama_cpp.gguf_of(model)
    if gguf is None:
        raise UsageError(f"--methods {llama_cpp.NAME}: llama.cpp reads GGUF files only; "
                         "give --model a .gguf file (or leave it out: the embedded model is one)")
    dies = llama_cpp.crashes(gguf) if gguf.is_file() else None
    if dies is not None:
        raise UsageError(f"--methods {llama_cpp.NAME}: {dies}")
    return gguf


def floor_lines(results: list[dict], n: int, floor_ms: float) -> list[str]:
    """Each measured method's TPOT at ``n`` tokens as a multiple of the bandwidth floor."""
    return [f"{r['method']} at {n} tokens: TPOT {r['tpot_ms']:.1f} ms = {r['tpot_ms'] / floor_ms:.1f}x "
            f"the bandwidth floor ({floor_ms:.2f} ms)" for r in results
            if r["ctx"] == n and r["status"] == "ok" and r.get("tpot_ms")]


def llama_cpp_lines(results: list[dict], n: int) -> list[str]:
    """Each method's TPOT against llama.cpp's at ``n`` tokens (its ``tpot_ratio_vs_llama_cpp``:
    against llama.cpp's steps timed in turns with its own), one line each."""
    rows = [r for r in results if r["ctx"] == n and r["status"] == "ok"]
    ref = next((r for r in rows if r["method"] == llama_cpp.NAME), None)
    if ref is None:
        return []
    return [f"{r['method']} at {n} tokens vs llama.cpp: TPOT {r['tpot_ms']:.1f} vs "
            f"{r['tpot_ms'] * r['tpot_ratio_vs_llama_cpp']:.1f} ms ({r['tpot_ratio_vs_llama_cpp']:.2f}x "
            f"llama.cpp's speed, steps in turns), prefill {r['prefill_tok_s']:.0f} vs "
            f"{ref['prefill_tok_s']:.0f} tokens/s" for r in rows
            if r["method"] != llama_cpp.NAME and r.get("tpot_ratio_vs_llama_cpp")]


def parse_positions(text: str | None, settings) -> list[str]:
    """``--positions``: one or more of remap, true, auto (distinct, in the given order); the
    profile's setting when not given."""
    from icecache.config import POSITIONS

    if text is None:
        return [settings.positions]
    out = []
    for p in (x.strip() for x in text.split(",")):
        if p not in POSITIONS:
            raise UsageError(f"--positions: '{p}' is not one of {', '.join(POSITIONS)}")
        if p in out:
            raise UsageError(f"--positions: '{p}' is given twice")
        if p == "remap" and settings.rope_scaling != "none":
            raise UsageError("--positions remap: the profile sets rope_scaling, which excludes it")
        out.append(p)
    return out


def positions_ratios(by_positions: dict[str, list]) -> list[str]:
    """Per method measured under the first and each other ``--positions`` value: their TPOT and
    prefill tokens/s, as ratios (the first value's over the other's)."""
    names = list(by_positions)
    first = {r.method: r for r in by_positions[names[0]] if r.status == "ok"}
    lines = []
    for other in names[1:]:
        for r in by_positions[other]:
            a = first.get(r.method)
            if a is None or r.status != "ok" or a.positions == r.positions:
                continue
            pre = (f", prefill tokens/s {a.prefill_tok_s:.1f} vs {r.prefill_tok_s:.1f} "
                   f"({a.prefill_tok_s / r.prefill_tok_s:.3f}x)") if a.prefill_tok_s and r.prefill_tok_s else ""
            lines.append(f"{r.method} at {r.ctx} tokens, positions {a.positions} vs {r.positions}: "
                         f"TPOT {a.tpot_ms:.1f} vs {r.tpot_ms:.1f} ms ({a.tpot_ms / r.tpot_ms:.3f}x){pre}")
    return lines


def row_line(r) -> str:
    """One row as one status line."""
    dense = ", every layer dense: within dense_until" if r.all_dense else ""
    if r.all_dense and r.clamped:
        dense += ", distances past the trained context clamped"
    head = f"{r.method} at {r.ctx} tokens" + (f" ({r.positions} positions{dense})" if r.positions else "") + ": "
    if r.status != "ok":
        return head + r.status + (f" ({r.reason})" if r.reason else "")
    mean = f", mean {r.tpot_mean_ms:.1f}" if r.tpot_mean_ms is not None else ""
    return (head + f"TPOT {r.tpot_ms:.1f} ms (p90 {r.tpot_p90_ms:.1f}{mean}), TT2T {r.tt2t_s:.1f} s, "
            f"resident KV {(r.device_kv_bytes or 0) / 2**20:.0f} MiB, host {(r.host_kv_bytes or 0) / 2**20:.0f} MiB, "
            f"peak RSS {(r.peak_rss_bytes or 0) / 2**30:.2f} GiB"
            + (f", device memory at its decode peak {r.peak_device_bytes / 2**30:.2f} GiB (weights included)"
               if r.gpu and r.peak_device_bytes else ""))


def print_bench_table(rows, n: int, label: str = "") -> None:
    """The rows as a table that fits 80 columns; statuses' reasons and KV sources as notes."""
    t = Table(title=f"icecache bench: {n} tokens" + (f", {label}" if label else ""), box=None, padding=(0, 1), pad_edge=False,
              collapse_padding=True)
    for c in ("method", "TT2T", "tok/s", "TPOT", "p90", "xfull", "xdense", "q/ld/at/rest", "KV",
              "host", "RSS"):
        t.add_column(c, justify="left" if c in ("method", "q/ld/at/rest") else "right", no_wrap=True)

    def f(x, fmt):
        if x is None:
            return "-"
        return format(x, ".0f" if fmt == ".1f" and abs(x) >= 100 else fmt)

    notes, sources = [], {}
    for r in rows:
        b = r.breakdown_ms
        parts = "/".join(f"{b[k]:.0f}" for k in ("index_query", "page_loading", "ice_attention", "rest_of_model")) if b else "-"
        if r.all_dense:
            parts = "dense"  # every layer dense (dense_until): no page was selected
        if r.status != "ok":
            notes.append(f"{r.method}: {r.status}" + (f" ({r.reason})" if r.reason else ""))
            t.add_row(escape(r.method), *(["-"] * 10))
            continue
        sources.setdefault(r.kv_source, []).append(r.method)
        t.add_row(escape(r.method), f(r.tt2t_s, ".1f"), f(r.prefill_tok_s, ".0f"), f(r.tpot_ms, ".1f"),
                  f(r.tpot_p90_ms, ".1f"), f(r.tpot_ratio_vs_full, ".1f"), f(r.tpot_ratio_vs_dense, ".1f"),
                  parts, f(r.device_kv_bytes and r.device_kv_bytes / 2**20, ".0f"),
                  f(r.host_kv_bytes is not None and r.host_kv_bytes / 2**20 or None, ".0f"),
                  f(r.peak_rss_bytes and r.peak_rss_bytes / 2**30, ".1f"))
    stderr.print(t)
    stderr.print("TT2T: time to the second token, s; tok/s: prefill; TPOT, p90: ms per output token; "
                 "xfull, xdense: times faster than full, dense; q/ld/at/rest: index query, page "
                 "loading, attention, rest of the model, ms (dense: every layer dense, within "
                 "dense_until); KV: resident KV (device pool + dense layers), MiB; host: host store, "
                 "MiB; RSS: peak process RSS, GiB.",
                 style="dim", markup=False)
    for src, methods in sources.items():
        stderr.print(f"KV from {src}: {', '.join(methods)}", style="dim", markup=False)
    for line in notes:
        stderr.print(line, markup=False)


def parse_size(text: str) -> int:
    t = text.strip().lower()
    try:
        if t.endswith("k"):
            return int(float(t[:-1]) * 1024)
        return int(t)
    except ValueError:
        raise UsageError(f"size '{text}' is not a size like 8192, 8k or 128k") from None


# The subcommands live in their own modules, each registering its command on bench_app when it is
# imported. They are imported here, once bench_app and the helpers they share (parse_size) exist,
# so that importing this module (as app.py does) gives the whole sub-app, with the commands in
# --help in the order of this line; hence the unsorted import.
from . import bench_index, bench_decode, bench_prefill  # noqa: E402, F401, I001
