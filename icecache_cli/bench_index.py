"""``icecache bench index``: the index's attention mass, recall and speed on keys and queries
captured from the model, and the table that prints them."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer
from rich.table import Table

from icecache.config import resolve_settings
from icecache.errors import UsageError

from .bench import bench_app, parse_size
from .options import ModelOpt as FullModelOpt
from .options import QuietOpt
from .output import Reporter, emit, stderr, user_errors


@bench_app.command("index")
def index(
    keys: Annotated[str, typer.Option("--keys", help="Key counts, comma-separated (8k = 8192).")] = "8k,32k,128k",
    layers: Annotated[str, typer.Option("--layers", help="Layers to capture (>= 2).")] = "2,15,29",
    queries: Annotated[int, typer.Option("--queries", min=1, help="Decode-step queries per layer.")] = 8,
    budgets: Annotated[str, typer.Option("--budgets", help="Budgets in tokens.")] = "64,128,256",
    beam: Annotated[str | None, typer.Option("--beam", help="Nodes expanded per level in a query, or several "
                                             "comma-separated (same keys). Default: the cpu profile's index_beam "
                                             "(auto: the beam a decode step of the model walks with).",
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
    walk_keys: Annotated[str | None, typer.Option("--walk-keys", help="The keys a decode step's walk scores: "
                                                  "float32, int8, or both comma-separated (same keys). Default: "
                                                  "the cpu profile's index_walk_keys.", show_default=False)] = None,
    top_rows: Annotated[str | None, typer.Option("--top-rows", help="A walk scans the levels above the bottom "
                                                 "whole while they hold at most this many keys (0: every level "
                                                 "walked), or several comma-separated (same keys). Default: the "
                                                 "cpu profile's index_top_rows.", show_default=False)] = None,
    model: FullModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document per size on stdout.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Index quality and speed on keys and queries captured from the model."""
    from icecache.bench.capture import capture
    from icecache.bench.index_bench import IndexBenchResult, run_layer
    from icecache.index import IndexConfig
    from icecache.index.config import MERGES, WALK_KEYS
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
        walk_keys = settings.tuned("index_walk_keys") if walk_keys is None else walk_keys
        walks = [w.strip() for w in walk_keys.split(",") if w.strip()]
        for w in walks:
            if w not in WALK_KEYS:
                raise UsageError(f"--walk-keys: '{w}' is not one of {', '.join(WALK_KEYS)}")
        top_rows = str(settings.tuned("index_top_rows")) if top_rows is None else top_rows
        tops = parse_whole_numbers(top_rows, "--top-rows", lambda r: r >= 0, "0 or more")
        beams = parse_whole_numbers(beam, "--beam", lambda b: b >= 1, "1 or more") if beam is not None else None
        loaded = load_model(model, settings, log=rep.info)
        if beams is None:  # the profile's, as a decode step of this model would walk
            from icecache.cache.selectors.dci import decode_beam
            from icecache.config import selector_settings
            from icecache.methods.factory import walk_dims

            beams = [decode_beam(selector_settings(settings, "dci"), walk_dims(loaded.model.config, settings))]
        frac = settings.tuned("index_beam_frac") if beam_frac is None else beam_frac
        configs = [IndexConfig(page_size=settings.page_size, beam=b, beam_frac=frac, pages=p, merge=m, refine=r,
                               walk_keys=w, top_rows=t)
                   for b in beams for p in modes for m in merges for r in refines for w in walks for t in tops]
        for n in sizes:
            rep.info(f"capturing {n} keys of layers {layer_ids} ...")
            cap = capture(loaded, n, layer_ids, num_queries=queries,
                          on_chunk=lambda done, total: rep.progress("capture", done, total))
            rep.close()
            for cfg in configs:
                res = IndexBenchResult(keys=n, budgets=budget_list)
                for layer in layer_ids:
                    rep.info(f"measuring layer {layer} (beam {cfg.beam}, beam_frac {cfg.beam_frac:g}, {cfg.pages} "
                             f"pages, {cfg.merge} merge, refine {cfg.refine}, {cfg.walk_keys} walk keys, "
                             f"top rows {cfg.top_rows})")
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
    t = Table(title=f"index bench: {s['keys']} keys, layers {s['layers']}, beam {s['config']['beam']} "
                f"(beam_frac {s['config']['beam_frac']:g}), {s['config']['pages']} pages, {s['config']['merge']} merge, "
                f"refine {s['config']['refine']}, {s['config']['walk_keys']} walk keys, top rows {s['config']['top_rows']}",
              box=None)
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



def parse_whole_numbers(text: str, flag: str, ok, allowed: str) -> list[int]:
    """A flag's comma-separated whole numbers, each passing ``ok`` (``allowed`` says which)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: '{text}' is not whole numbers, comma-separated") from None
    if not values or not all(ok(v) for v in values):
        raise UsageError(f"{flag}: each value must be {allowed}")
    return values
