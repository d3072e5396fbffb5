"""``icecache bench prefill``: prefill wall time, tokens/s and peak RSS per prefill mode."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from icecache.config import resolve_settings
from icecache.errors import UsageError

from .bench import bench_app, parse_size
from .options import BenchOptions, with_options
from .output import Reporter, emit, stderr, user_errors


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

