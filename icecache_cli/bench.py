"""``icecache bench``: measurements that print physical units and same-run ratios."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from icecache.bench import llama_cpp
from icecache.config import resolve_settings
from icecache.errors import UsageError
from icecache.variants import parse_methods

from .options import BenchOptions, QuietOpt, with_options
from .options import ModelOpt as FullModelOpt
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
    """End-to-end bench: TT2T, tokens/s, TPOT (median, p90), breakdown and memory per method.

    A method whose memory need (estimated) exceeds what is available gets a skipped row instead
    of running. Each row is printed (stderr; with --json also as a JSON line on stdout) and
    appended to --out as soon as it is measured; with --json the last line holds all rows.
    """
    if context.invoked_subcommand is not None:
        return
    from icecache.bench import full_bench
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
        loaded = load_model(opts.model, settings, log=rep.info)
        results = []
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
            if not quiet and llama_cpp.NAME in method_list:
                for line in llama_cpp_lines(results, n):
                    stderr.print(line, markup=False)
            if not quiet and len(position_list) > 1:
                for line in positions_ratios(by_positions):
                    stderr.print(line, markup=False)
        if as_json:
            emit(json.dumps({"results": results}))


def check_llama_cpp(model: str | None) -> Path:
    """``--methods ...,llama.cpp``: the GGUF file it runs; a one-line error when llama-cpp-python
    is not installed or the model is not a GGUF file."""
    why = llama_cpp.missing()
    if why is not None:
        raise UsageError(f"--methods {llama_cpp.NAME}: {why}")
    gguf = llama_cpp.gguf_of(model)
    if gguf is None:
        raise UsageError(f"--methods {llama_cpp.NAME}: llama.cpp reads GGUF files only; "
                         "give --model a .gguf file (or leave it out: the embedded model is one)")
    return gguf


def llama_cpp_lines(results: list[dict], n: int) -> list[str]:
    """Each method's TPOT against llama.cpp's at ``n`` tokens (its ``tpot_ratio_vs_llama_cpp``),
    one line each."""
    rows = [r for r in results if r["ctx"] == n and r["status"] == "ok"]
    ref = next((r for r in rows if r["method"] == llama_cpp.NAME), None)
    if ref is None:
        return []
    return [f"{r['method']} at {n} tokens vs llama.cpp: TPOT {r['tpot_ms']:.1f} vs {ref['tpot_ms']:.1f} ms "
            f"({r['tpot_ratio_vs_llama_cpp']:.2f}x llama.cpp's speed), prefill {r['prefill_tok_s']:.0f} vs "
            f"{ref['prefill_tok_s']:.0f} tokens/s" for r in rows if r["method"] != llama_cpp.NAME]


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
    return (head + f"TPOT {r.tpot_ms:.1f} ms (p90 {r.tpot_p90_ms:.1f}), TT2T {r.tt2t_s:.1f} s, "
            f"resident KV {(r.device_kv_bytes or 0) / 2**20:.0f} MiB, host {(r.host_kv_bytes or 0) / 2**20:.0f} MiB, "
            f"peak RSS {(r.peak_rss_bytes or 0) / 2**30:.2f} GiB")


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


@bench_app.command("index")
def index(
    keys: Annotated[str, typer.Option("--keys", help="Key counts, comma-separated (8k = 8192).")] = "8k,32k,128k",
    layers: Annotated[str, typer.Option("--layers", help="Layers to capture (>= 2).")] = "2,15,29",
    queries: Annotated[int, typer.Option("--queries", min=1, help="Decode-step queries per layer.")] = 8,
    budgets: Annotated[str, typer.Option("--budgets", help="Budgets in tokens.")] = "64,128,256",
    beam: Annotated[str | None, typer.Option("--beam", help="Nodes expanded per level in a query, or several "
                                             "comma-separated (same keys). Default: the cpu profile's index_beam.",
                                             show_default=False)] = None,
    beam_frac: Annotated[float | None, typer.Option("--beam-frac", min=0.0, max=0.999, help="...or this share of "
                                                    "the keys if more. Default: the cpu profile's index_beam_frac.",
                                                    show_default=False)] = None,
    pages: Annotated[str | None, typer.Option("--pages", help="How the tree cuts a node's children into pages: "
                                              "projection, similar, or both comma-separated (same keys). "
                                              "Default: the cpu profile's index_pages.", show_default=False)] = None,
    merge: Annotated[str | None, typer.Option("--merge", help="How a GQA group shares its KV head's pages: "
                                              "ranks, mass, peaks, or several comma-separated (same keys). "
                                              "Default: the cpu profile's index_merge.", show_default=False)] = None,
    refine: Annotated[str | None, typer.Option("--refine", help="Lloyd passes over the bottom level's grouping "
                                               "(0: none), or several comma-separated (same keys). Default: "
                                               "the cpu profile's index_refine.", show_default=False)] = None,
    pick: Annotated[str, typer.Option("--pick", help="Token-pick multiples measured beside the pages "
                                      "(ice_pickM: the budget's best tokens among M x the budget in "
                                      "pages), comma-separated; 0: none.")] = "4",
    model: FullModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document per size on stdout.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Index quality and speed on keys and queries captured from the model."""
    from icecache.bench.capture import capture
    from icecache.bench.index_bench import IndexBenchResult, run_layer
    from icecache.index import IndexConfig
    from icecache.index.config import MERGES
    from icecache.models import load_model

    with user_errors(), Reporter(quiet) as rep:
        sizes = [parse_size(s) for s in keys.split(",") if s.strip()]
        layer_ids = [int(x) for x in layers.split(",") if x.strip()]
        budget_list = sorted(int(x) for x in budgets.split(",") if x.strip())
        settings = resolve_settings("cpu")
        for b in budget_list:
            if b <= 0 or b % settings.page_size:
                raise UsageError(f"--budgets: {b} is not a positive multiple of {settings.page_size}")
        pages = settings.tuned("index_pages") if pages is None else pages
        merge = settings.tuned("index_merge") if merge is None else merge
        refine = str(settings.tuned("index_refine")) if refine is None else refine
        modes = [m.strip() for m in pages.split(",") if m.strip()]
        for m in modes:
            if m not in ("projection", "similar"):
                raise UsageError(f"--pages: '{m}' is not projection or similar")
        merges = [m.strip() for m in merge.split(",") if m.strip()]
        for m in merges:
            if m not in MERGES:
                raise UsageError(f"--merge: '{m}' is not one of {', '.join(MERGES)}")
        refines = parse_whole_numbers(refine, "--refine", lambda r: 0 <= r <= 10, "from 0 to 10")
        picks = tuple(m for m in parse_whole_numbers(pick, "--pick", lambda m: m == 0 or 2 <= m <= 16,
                                                     "0 or from 2 to 16") if m)
        beams = (parse_whole_numbers(beam, "--beam", lambda b: b >= 1, "1 or more") if beam is not None
                 else [settings.tuned("index_beam")])
        loaded = load_model(model, settings, log=rep.info)
        frac = settings.tuned("index_beam_frac") if beam_frac is None else beam_frac
        configs = [IndexConfig(page_size=settings.page_size, beam=b, beam_frac=frac, pages=p, merge=m, refine=r)
                   for b in beams for p in modes for m in merges for r in refines]
        for n in sizes:
            rep.info(f"capturing {n} keys of layers {layer_ids} ...")
            cap = capture(loaded, n, layer_ids, num_queries=queries,
                          on_chunk=lambda done, total: rep.progress("capture", done, total))
            rep.close()
            for cfg in configs:
                res = IndexBenchResult(keys=n, budgets=budget_list)
                for layer in layer_ids:
                    rep.info(f"measuring layer {layer} (beam {cfg.beam}, beam_frac {cfg.beam_frac:g}, {cfg.pages} "
                             f"pages, {cfg.merge} merge, refine {cfg.refine})")
                    run_layer(res, cap.keys[layer], cap.queries[layer], settings.page_size,
                              settings.sink_pages, settings.window_pages, cfg, picks)
                summary = res.summary()
                summary["config"] = dataclasses.asdict(cfg)
                summary["layers"] = layer_ids
                if not quiet:
                    print_table(summary)
                if as_json:
                    emit(json.dumps(summary))


def print_table(s: dict) -> None:
    t = Table(title=f"index bench: {s['keys']} keys, layers {s['layers']}, beam {s['config']['beam']} "
                f"(beam_frac {s['config']['beam_frac']:g}), {s['config']['pages']} pages, {s['config']['merge']} merge, "
                f"refine {s['config']['refine']}", box=None)
    # one row per selection, one column per budget: the table stays narrow as methods are added
    t.add_column("attention mass")
    by_budget = s["attention_mass_by_budget"]
    for b in by_budget:
        t.add_column(f"budget {b}", justify="right")
    for m in next(iter(by_budget.values())):
        t.add_row(m, *(f"{by_budget[b][m]:.3f}" for b in by_budget))
    stderr.print(t)
    q = s["query_us_per_head"]
    stderr.print(
        f"recall@64 {s['recall_at_64']:.3f}  recall@256 {s['recall_at_256']:.3f}  "
        f"query {q['ice']:.0f} us/head vs exact {q['exact']:.0f} us/head ({s['speedup_vs_exact']:.2f}x)  "
        f"build {s['build_us_per_key']:.2f} us/key  insert {s['insert_us_per_key']:.2f} us/key  "
        f"{s['bytes_per_key']:.0f} B/key", markup=False)
    if s.get("page_fill"):
        stderr.print("page fill (keys per page / page size): "
                     + ", ".join(f"{m} {v:.3f}" for m, v in s["page_fill"].items()), markup=False)


@bench_app.command("decode")
@with_options("opts", BenchOptions)
def decode(
    ctx: Annotated[str, typer.Option("--ctx", help="Context lengths, comma-separated (16k = 16384).")] = "16k,32k",
    methods: Annotated[str, typer.Option("--methods", help="Methods to compare; the first is the baseline. "
                                         "A method may change profile keys for its own row: "
                                         "'ice\\[carry_pages=8]', 'ice\\[index_merge=mass,index_refine=2]'.")] = "full,ice",
    steps: Annotated[int, typer.Option("--decode-steps", min=1, help="Timed decode steps.")] = 16,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Turns the methods take in order, each timing its share of the steps (A B A B ...): a drift of the machine's speed then slows every method alike (every method's cache is held at once). 1: each method's steps in one go, one cache at a time.")] = 4,
    linears: Annotated[bool, typer.Option("--time-linears", help="Also time the linear layers (the LM head included) in the breakdown, by forward hooks (a few microseconds per layer more per step).")] = False,
    opts: BenchOptions = None,
) -> None:
    """Time per output token, resident KV bytes and the per-token breakdown, per method."""
    from icecache.bench import decode_bench
    from icecache.models import load_model

    budget, profile, model, as_json, quiet = opts.budget, opts.profile, opts.model, opts.as_json, opts.quiet
    with user_errors(), Reporter(quiet) as rep:
        sizes = [parse_size(s) for s in ctx.split(",") if s.strip()]
        settings = resolve_settings(profile, budget=budget, weights=opts.weights)
        variants = parse_methods(methods, settings)
        loaded = load_model(model, settings, log=rep.info)
        results = []
        for n in sizes:
            base = None
            rep.info(f"prefill of {n} tokens (shared by the methods) ...")
            shared = decode_bench.prefill(loaded, settings, n, lambda d, t: rep.progress("prefill", d, t))
            rep.close()
            rep.info(f"prefill: {shared.seconds:.1f} s")
            turns = min(rounds, steps)
            if turns == 1:  # one method after the other: one method's cache alive at a time
                timed = []
                for label, method, method_settings in variants:
                    rep.info(f"{label} at {n} tokens: decoding ...")
                    timed.append(decode_bench.run(loaded, method_settings, method, n, steps=steps, shared=shared,
                                                  linears=linears))
            else:  # every method's cache alive at once, taking turns
                timers = []
                for label, method, method_settings in variants:
                    rep.info(f"{label} at {n} tokens: warming up ...")
                    timers.append(decode_bench.start(loaded, method_settings, method, shared, linears=linears,
                                                       steps=steps))
                rep.info(f"decoding: {steps} timed steps per method in {turns} interleaved rounds ...")
                timed = decode_bench.interleaved(timers, steps, turns)
                del timers
            for (label, _method, _s), r in zip(variants, timed, strict=True):
                r.method = label
                row = r.as_dict()
                base = base or r
                row["tpot_ratio_vs_" + base.method] = base.tpot_ms / r.tpot_ms
                row["device_kv_share_of_" + base.method] = r.device_kv_bytes / max(1, base.device_kv_bytes)
                row["sparse_layers_device_kv_share_of_" + base.method] = (
                    r.device_kv_bytes_sparse_layers / max(1, base.device_kv_bytes_sparse_layers))
                results.append(row)
                if not quiet:
                    stderr.print(
                        f"{label:>9} ctx {r.ctx:>6}: {r.tpot_ms:7.1f} ms/token (p90 {r.tpot_p90_ms:.1f}), "
                        f"speed-up {base.tpot_ms / r.tpot_ms:.2f}x vs {base.method}; TT2T {r.tt2t_s:.1f} s; "
                        f"device KV {r.device_kv_bytes / 2**20:.1f} MiB "
                        f"({100 * r.device_kv_bytes / max(1, base.device_kv_bytes):.1f}% of {base.method}; layers "
                        f">= {settings.dense_layers}: {100 * r.device_kv_bytes_sparse_layers / max(1, base.device_kv_bytes_sparse_layers):.2f}%), "
                        f"host KV {r.host_kv_bytes / 2**20:.1f} MiB"
                        + ("; every layer dense (within dense_until"
                           + (", distances past the trained context clamped" if r.clamped else "") + ")"
                           if r.all_dense else "")
                        + ("; per token: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r.breakdown_ms.items())
                           if r.breakdown_ms else ""), markup=False)
            del shared
        if as_json:
            emit(json.dumps({"results": results}))


@bench_app.command("prefill")
@with_options("opts", BenchOptions)
def prefill(
    ctx: Annotated[str, typer.Option("--ctx", help="Prompt lengths, comma-separated (16k = 16384).")] = "8k,16k",
    modes: Annotated[str, typer.Option("--modes", help="Prefill modes: full, dense, ice, ice-serial, sparse, sparse-serial; the first is the baseline.")] = "full,ice,ice-serial",
    chunk_size: Annotated[int | None, typer.Option("--chunk-size", min=1, help="Prompt tokens per chunk (default: the profile's).", show_default=False)] = None,
    opts: BenchOptions = None,
) -> None:
    """Prefill wall time (index included), tokens/s and peak RSS per prefill mode."""
    from icecache.bench import prefill_bench
    from icecache.bench.decode_bench import context_ids
    from icecache.models import load_model

    budget, profile, model, as_json, quiet = opts.budget, opts.profile, opts.model, opts.as_json, opts.quiet
    with user_errors(), Reporter(quiet) as rep:
        sizes = [parse_size(s) for s in ctx.split(",") if s.strip()]
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
        for m in mode_list:
            if m not in prefill_bench.MODES:
                raise UsageError(f"--modes: unknown mode '{m}' (known: {', '.join(prefill_bench.MODES)})")
        settings = resolve_settings(profile, budget=budget, chunk_size=chunk_size, weights=opts.weights)
        loaded = load_model(model, settings, log=rep.info)
        results, first_rate = [], {}
        rep.info("warming up (kernels compile on first use) ...")
        prefill_bench.warm_up(loaded, settings, mode_list,
                              context_ids(loaded.tokenizer, 2 * settings.chunk_size + 100))
        for n in sizes:
            ids = context_ids(loaded.tokenizer, n)
            base = None
            for mode in mode_list:
                rep.info(f"{mode} prefill of {n} tokens ...")
                r = prefill_bench.run(loaded, settings, mode, ids,
                                      on_progress=lambda ph, d, t: rep.progress(ph, d, t) if ph == "prefill" else None)
                rep.close()
                base = base or r
                first_rate.setdefault(mode, r)
                row = r.as_dict() | {
                    "time_ratio_vs_" + base.mode: r.seconds / base.seconds,
                    "rate_ratio_vs_ctx_" + str(first_rate[mode].ctx): r.tokens_per_s / first_rate[mode].tokens_per_s}
                results.append(row)
                if not quiet:
                    stderr.print(
                        f"{mode:>13} ctx {r.ctx:>6}: {r.seconds:8.1f} s ({r.tokens_per_s:6.0f} tokens/s; "
                        f"{r.seconds / base.seconds:.3f}x the time of {base.mode}; tokens/s "
                        f"{r.tokens_per_s / first_rate[mode].tokens_per_s:.2f}x its own at {first_rate[mode].ctx}); "
                        f"index build {r.index_build_s:.1f} s + inserts {r.index_insert_s:.1f} s (CPU time of the "
                        f"worker); resident KV {r.device_kv_bytes / 2**20:.1f} MiB, host store "
                        f"{r.host_kv_bytes / 2**20:.1f} MiB; peak RSS {r.peak_rss_bytes / 2**30:.2f} GiB",
                        markup=False)
        if as_json:
            emit(json.dumps({"results": results}))


def parse_whole_numbers(text: str, flag: str, ok, allowed: str) -> list[int]:
    """A flag's comma-separated whole numbers, each passing ``ok`` (``allowed`` says which)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: '{text}' is not whole numbers, comma-separated") from None
    if not values or not all(ok(v) for v in values):
        raise UsageError(f"{flag}: each value must be {allowed}")
    return values
