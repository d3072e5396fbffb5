"""``icecache bench``: measurements that print physical units and same-run ratios."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer
from rich.table import Table

from icecache.config import resolve_settings
from icecache.errors import UsageError

from .output import Reporter, emit, stderr, user_errors

bench_app = typer.Typer(help="Benchmarks (figures on stderr; --json: one JSON line on stdout).", no_args_is_help=True)


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
    beam: Annotated[int, typer.Option("--beam", min=1, help="Nodes expanded per level in a query.")] = 48,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (default: embedded).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document per size on stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="Nothing on stderr but errors.")] = False,
) -> None:
    """Index quality and speed on keys and queries captured from the model."""
    from icecache.bench.index_bench import IndexBenchResult, run_layer
    from icecache.index import IndexConfig
    from icecache.index.capture import capture
    from icecache.models import load_model

    with user_errors(), Reporter(quiet) as rep:
        sizes = [parse_size(s) for s in keys.split(",") if s.strip()]
        layer_ids = [int(x) for x in layers.split(",") if x.strip()]
        budget_list = sorted(int(x) for x in budgets.split(",") if x.strip())
        settings = resolve_settings("cpu")
        for b in budget_list:
            if b <= 0 or b % settings.page_size:
                raise UsageError(f"--budgets: {b} is not a positive multiple of {settings.page_size}")
        loaded = load_model(model, settings, log=rep.info)
        cfg = IndexConfig(page_size=settings.page_size, beam=beam)
        for n in sizes:
            rep.info(f"capturing {n} keys of layers {layer_ids} ...")
            cap = capture(loaded, n, layer_ids, num_queries=queries,
                          on_chunk=lambda done, total: rep.progress("capture", done, total))
            rep.close()
            res = IndexBenchResult(keys=n, budgets=budget_list)
            for layer in layer_ids:
                rep.info(f"measuring layer {layer}")
                run_layer(res, cap.keys[layer], cap.queries[layer], settings.page_size,
                          settings.sink_pages, settings.window_pages, cfg)
            summary = res.summary()
            summary["config"] = dataclasses.asdict(cfg)
            summary["layers"] = layer_ids
            if not quiet:
                print_table(summary)
            if as_json:
                emit(json.dumps(summary))


def print_table(s: dict) -> None:
    t = Table(title=f"index bench: {s['keys']} keys, layers {s['layers']}", box=None)
    t.add_column("budget")
    methods = list(next(iter(s["attention_mass_by_budget"].values())))
    for m in methods:
        t.add_column(f"mass {m}")
    for b, d in s["attention_mass_by_budget"].items():
        t.add_row(b, *(f"{d[m]:.3f}" for m in methods))
    stderr.print(t)
    q = s["query_us_per_head"]
    stderr.print(
        f"recall@64 {s['recall_at_64']:.3f}  recall@256 {s['recall_at_256']:.3f}  "
        f"query {q['ice']:.0f} us/head vs exact {q['exact']:.0f} us/head ({s['speedup_vs_exact']:.2f}x)  "
        f"build {s['build_us_per_key']:.2f} us/key  insert {s['insert_us_per_key']:.2f} us/key  "
        f"{s['bytes_per_key']:.0f} B/key", markup=False)


@bench_app.command("decode")
def decode(
    ctx: Annotated[str, typer.Option("--ctx", help="Context lengths, comma-separated (16k = 16384).")] = "16k,32k",
    methods: Annotated[str, typer.Option("--methods", help="Methods to compare; the first is the baseline.")] = "full,ice",
    budget: Annotated[int | None, typer.Option("--budget", help="Budget in tokens (default: the profile's).", show_default=False)] = None,
    steps: Annotated[int, typer.Option("--decode-steps", min=1, help="Timed decode steps.")] = 16,
    profile: Annotated[str | None, typer.Option("--profile", "-p", help="Hardware profile.", show_default=False)] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (default: embedded).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="Nothing on stderr but errors.")] = False,
) -> None:
    """Time per output token, resident KV bytes and the per-token breakdown, per method."""
    from icecache.bench import decode_bench
    from icecache.methods import check_method
    from icecache.models import load_model

    with user_errors(), Reporter(quiet) as rep:
        sizes = [parse_size(s) for s in ctx.split(",") if s.strip()]
        method_list = [check_method(m.strip()) for m in methods.split(",") if m.strip()]
        settings = resolve_settings(profile, budget=budget)
        loaded = load_model(model, settings, log=rep.info)
        results = []
        for n in sizes:
            base = None
            rep.info(f"prefill of {n} tokens (shared by the methods) ...")
            shared = decode_bench.prefill(loaded, settings, n, lambda d, t: rep.progress("prefill", d, t))
            rep.close()
            rep.info(f"prefill: {shared.seconds:.1f} s")
            for method in method_list:
                rep.info(f"{method} at {n} tokens: decoding ...")
                r = decode_bench.run(loaded, settings, method, n, steps=steps, shared=shared)
                row = r.as_dict()
                base = base or r
                row["tpot_ratio_vs_" + base.method] = base.tpot_ms / r.tpot_ms
                row["device_kv_share_of_" + base.method] = r.device_kv_bytes / max(1, base.device_kv_bytes)
                row["sparse_layers_device_kv_share_of_" + base.method] = (
                    r.device_kv_bytes_sparse_layers / max(1, base.device_kv_bytes_sparse_layers))
                results.append(row)
                if not quiet:
                    stderr.print(
                        f"{method:>9} ctx {r.ctx:>6}: {r.tpot_ms:7.1f} ms/token (p90 {r.tpot_p90_ms:.1f}), "
                        f"speed-up {base.tpot_ms / r.tpot_ms:.2f}x vs {base.method}; TT2T {r.tt2t_s:.1f} s; "
                        f"device KV {r.device_kv_bytes / 2**20:.1f} MiB "
                        f"({100 * r.device_kv_bytes / max(1, base.device_kv_bytes):.1f}% of {base.method}; layers "
                        f">= {settings.dense_layers}: {100 * r.device_kv_bytes_sparse_layers / max(1, base.device_kv_bytes_sparse_layers):.2f}%), "
                        f"host KV {r.host_kv_bytes / 2**20:.1f} MiB"
                        + ("; per token: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r.breakdown_ms.items())
                           if r.breakdown_ms else ""), markup=False)
            del shared
        if as_json:
            emit(json.dumps({"results": results}))
