"""``icecache bench decode``: time per output token, resident KV and the per-token breakdown
per method, from one shared prefill per context length."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from icecache.config import resolve_settings
from icecache.variants import parse_methods

from .bench import bench_app, parse_size
from .options import BenchOptions, with_options
from .output import Reporter, emit, stderr, user_errors


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
                        f"{label:>9} ctx {r.ctx:>6}: {r.tpot_ms:7.1f} ms/token (p90 {r.tpot_p90_ms:.1f}, mean {r.tpot_mean_ms:.1f}), "
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

