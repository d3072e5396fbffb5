"""The decode benchmark's bookkeeping on a short context (figures themselves are not asserted)."""

from __future__ import annotations

import pytest

from icecache.bench import decode_bench
from icecache.cache.spec import SPAN_PAGES


def test_decode_bench_shared_prefill(loaded, cpu_settings):
    settings = cpu_settings.replace(budget=64)
    shared = decode_bench.prefill(loaded, settings, 400)
    assert len(shared.ids) == 400
    full = decode_bench.run(loaded, settings, "full", 400, steps=2, shared=shared)
    ice = decode_bench.run(loaded, settings, "ice", 400, steps=2, shared=shared)
    assert full.ctx == ice.ctx == 400 and full.tpot_ms > 0 and ice.tpot_ms > 0
    # Resident KV of the sparse layers: sink + window + a page of slack + budget 64 + the pinned
    # passages' slots (3 pages each); the cpu profile's: 32 + 128 + 16 + 64 + 144 = 384 tokens.
    S = settings.page_size
    resident = (settings.sink_pages + settings.window_pages + 1) * S + 64 + settings.answer_spans * SPAN_PAGES * S
    assert (settings.window_pages, settings.answer_spans, resident) == (8, 3, 384)
    per_token_layer = 2 * 3 * 64 * 4  # K and V, 3 KV heads, head_dim 64, float32
    assert ice.device_kv_bytes_sparse_layers == 28 * resident * per_token_layer
    warm = 2  # warm-up steps
    assert full.device_kv_bytes_sparse_layers == 28 * (400 + warm + 2) * per_token_layer  # prompt + warm-up + 2 timed
    assert ice.host_kv_bytes > 0 and full.host_kv_bytes == 0
    assert set(ice.breakdown_ms) == {"index_query", "page_loading", "ice_attention", "rest_of_model"}


def test_interleaved_rounds_decode_as_each_method_alone(loaded, cpu_settings):
    """Timers taking turns on the shared model (A B A B ...) decode exactly what each decodes
    alone: every turn restores its session's attention and RoPE. The timed steps are split
    over the rounds."""
    settings = cpu_settings.replace(budget=64)
    shared = decode_bench.prefill(loaded, settings, 300)
    alone = {}
    for m in ("full", "ice"):
        t = decode_bench.start(loaded, settings, m, shared)
        t.advance(7)
        alone[m] = t.tokens
    timers = [decode_bench.start(loaded, settings, m, shared) for m in ("full", "ice")]
    rows = decode_bench.interleaved(timers, 7, 3)
    assert [t.tokens for t in timers] == [alone["full"], alone["ice"]]
    warm = 2  # warm-up steps
    assert [len(t.times) for t in timers] == [7, 7] and len(alone["full"]) == 7 + warm
    assert [r.method for r in rows] == ["full", "ice"] and all(r.ctx == 300 for r in rows)
    assert set(rows[1].breakdown_ms) == {"index_query", "page_loading", "ice_attention", "rest_of_model"}


def test_linear_clock_times_every_linear_layer_and_leaves_no_hook(loaded, cpu_settings):
    model = loaded.model
    n_linear = sum(1 for m in model.modules() if decode_bench.is_linear(m))
    assert n_linear == 7 * model.config.num_hidden_layers + 1  # q k v o gate up down, LM head
    settings = cpu_settings.replace(budget=64)
    shared = decode_bench.prefill(loaded, settings, 300)
    for method in ("full", "ice"):
        t = decode_bench.start(loaded, settings, method, shared, linears=True)
        t.advance(3)
        r = t.result()
        assert 0 < r.breakdown_ms["linears"] <= 1000 * sum(t.times) / len(t.times)
        assert "rest_of_model" in r.breakdown_ms
        assert ("index_query" in r.breakdown_ms) == (method == "ice")
    # the hooks are gone once the timed steps are over
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    full = decode_bench.start(loaded, settings, "full", shared)
    full.session.activate()
    with decode_bench.LinearClock(model) as clock:
        assert len(clock._handles) == 2 * n_linear
        full.advance(1)
    assert clock.seconds > 0 and not any(m._forward_hooks for m in model.modules())


def test_bench_command_both_kv_routes(tmp_path, quick_profile):
    """`icecache bench --ctx`: a context under --full-prefill-max from the shared full prefill,
    one over it from the ice sparse prefill; every row measured, ratios to full and dense."""
    import json

    from .conftest import run_cli

    r = run_cli(["bench", "--ctx", "300,700", "--methods", "full,dense,ice", "--decode-steps", "2",
                 "--full-prefill-max", "400", "--budget", "64", "--out", str(tmp_path), "--json",
                 "--profile", quick_profile])
    assert r.returncode == 0, r.stderr.decode()
    rows = json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]
    assert [(x["method"], x["ctx"]) for x in rows] == [
        (m, n) for n in (300, 700) for m in ("full", "dense", "ice")]
    for x in rows:
        assert x["status"] == "ok" and x["tpot_ms"] > 0 and x["tt2t_s"] > 0 and x["peak_rss_bytes"] > 0
        assert x["tpot_mean_ms"] == pytest.approx(x["tpot_ms"])  # (of two steps the median is the mean)
        assert x["tpot_ratio_vs_full"] > 0 and x["tpot_ratio_vs_dense"] > 0
        assert x["peak_device_bytes"] >= x["device_kv_bytes"] > 0
    assert {x["kv_source"] for x in rows if x["ctx"] == 300} == {"full prefill (shared)"}
    assert [x["kv_source"] for x in rows if x["ctx"] == 700] == [
        "sparse prefill (ice)", "sparse prefill (ice)", "own sparse prefill"]
    ice = [x for x in rows if x["method"] == "ice"]
    # The sparse prefill's pool (1024 tokens per KV head) and chunk window are resident during
    # the prefill: ice's peak lies above what it keeps for decoding.
    by = {(x["method"], x["ctx"]): x for x in rows}
    assert by[("ice", 700)]["peak_device_bytes"] > by[("ice", 700)]["device_kv_bytes"]
    assert all(x["host_kv_bytes"] > 0 and set(x["breakdown_ms"]) >= {"index_query", "rest_of_model"}
               for x in ice)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 6
    capped = run_cli(["bench", "--ctx", "300", "--methods", "full", "--max-seconds", "0", "--json"])
    assert capped.returncode == 0, capped.stderr.decode()
    row = json.loads(capped.stdout.decode().strip().splitlines()[-1])["results"][0]
    assert row["status"] == "over time cap" and row["tpot_ms"] is None and "> 0 s" in row["reason"]


@pytest.mark.slow  # about a minute; the bench's sparse and shared prefills are also run by test_prefill.py
def test_bench_prefill_modes(tmp_path, quick_profile):
    import json

    from .conftest import run_cli

    r = run_cli(["bench", "prefill", "--ctx", "300,500", "--modes", "full,ice,ice-serial,sparse",
                 "--chunk-size", "128", "--json", "--profile", quick_profile])
    assert r.returncode == 0, r.stderr.decode()
    rows = json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]
    assert [(x["mode"], x["ctx"]) for x in rows] == [
        (m, n) for n in (300, 500) for m in ("full", "ice", "ice-serial", "sparse")]
    for x in rows:
        assert x["seconds"] > 0 and x["tokens_per_s"] > 0 and x["peak_rss_bytes"] > 0
        assert (x["host_kv_bytes"] > 0) == (x["mode"] != "full")
        assert x["time_ratio_vs_full"] > 0
    assert all(x["index_build_s"] > 0 for x in rows if x["mode"] in ("ice", "ice-serial"))
    assert all(x["index_insert_s"] > 0 for x in rows if x["mode"] == "sparse" and x["ctx"] == 500)
    bad = run_cli(["bench", "prefill", "--modes", "fast"])
    assert bad.returncode == 2 and "unknown mode 'fast'" in bad.stderr.decode()


def test_bench_skips_what_cannot_fit_and_hands_rows_over_as_measured(loaded, cpu_settings, monkeypatch):
    """A method whose estimated need exceeds what is available gets a skipped row and the others
    still run; each row reaches ``on_row`` when it is measured; the estimates are not below the
    KV bytes the methods really hold."""
    from icecache import memory
    from icecache.bench import full_bench

    settings = cpu_settings.replace(budget=64)
    real_need = memory.need_bytes
    monkeypatch.setattr(full_bench, "need_bytes", lambda m, *a, **k: memory.Need(
        0, 2**50) if m == "full" else real_need(m, *a, **k))
    seen = []
    rows = full_bench.run_ctx(loaded, settings, ["full", "dense", "streaming", "ice"], 300, steps=1,
                              warmup=1, on_row=lambda r: seen.append((r.method, r.status)))
    assert seen == [("full", "skipped"), ("dense", "ok"), ("streaming", "ok"), ("ice", "ok")]
    full = rows[0]
    assert full.status == "skipped" and full.reason.startswith("needs 1048576.0 GiB, ")
    assert full.reason.endswith(" GiB available") and full.tpot_ms is None
    for r in rows[1:]:
        need = real_need(r.method, loaded.model.config, settings, 300 + 1 + 1 + 1)
        assert r.device_kv_bytes + r.host_kv_bytes <= need.total, r.method


def test_bench_keeps_prompt_queries_only_for_a_method_that_reads_them(loaded, cpu_settings, monkeypatch):
    """The shared prefill records the prompt's queries (9% of its speed at 8k) only when a method
    of the run reads them (snapkv, h2o); then that method's row still runs from them."""
    from icecache.bench import full_bench

    real = full_bench.prefill_once
    seen = []

    def spy(*args, observation=32, **kwargs):
        seen.append(observation)
        return real(*args, observation=observation, **kwargs)

    monkeypatch.setattr(full_bench, "prefill_once", spy)
    settings = cpu_settings.replace(budget=64)
    full_bench.run_ctx(loaded, settings, ["full", "ice"], 300, steps=1, warmup=1)
    rows = full_bench.run_ctx(loaded, settings, ["ice", "snapkv"], 300, steps=1, warmup=1)
    assert seen == [0, 32]
    assert [(r.method, r.status) for r in rows] == [("ice", "ok"), ("snapkv", "ok")]


@pytest.mark.slow  # about a minute; remapped and true positions are compared by test_positions.py
def test_bench_positions_measured_side_by_side(quick_profile):
    """`icecache bench --positions remap,true`: each positions value gets its own prefill and
    rows in one run (labelled with the session's choice), and a line compares their TPOT and
    prefill tokens/s; a bad value is a usage error before the model loads."""
    import json

    from .conftest import run_cli

    r = run_cli(["bench", "--ctx", "700", "--methods", "ice", "--decode-steps", "2", "--full-prefill-max",
                 "400", "--budget", "64", "--positions", "remap,true", "--json", "--profile", quick_profile])
    assert r.returncode == 0, r.stderr.decode()
    rows = json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]
    assert [(x["method"], x["positions"], x["kv_source"]) for x in rows] == [
        ("ice", "remap", "own sparse prefill"), ("ice", "true", "own sparse prefill")]
    assert all(x["status"] == "ok" and x["tpot_ms"] > 0 and x["prefill_tok_s"] > 0 for x in rows)
    err = r.stderr.decode()
    assert "ice at 700 tokens, positions remap vs true: TPOT" in err and "prefill tokens/s" in err
    bad = run_cli(["bench", "--ctx", "700", "--positions", "remap,sideways"])
    assert bad.returncode == 2 and "'sideways' is not one of" in bad.stderr.decode()
    twice = run_cli(["bench", "--ctx", "700", "--positions", "true,true"])
    assert twice.returncode == 2 and "given twice" in twice.stderr.decode()


def test_method_variants_change_profile_keys_for_their_row(cpu_settings):
    """``--methods full,ice[answer_spans=4,index_merge=mass]``: brackets keep their commas, the
    keys are checked as a profile's, and a bad one is a usage error naming it."""
    from icecache.errors import UsageError
    from icecache.variants import parse_variant, split_methods

    assert split_methods("full, ice[answer_spans=4,index_merge=mass],quest") == [
        "full", "ice[answer_spans=4,index_merge=mass]", "quest"]
    label, method, s = parse_variant("ice[answer_spans=4,index_merge=mass]", cpu_settings)
    assert (label, method, s.answer_spans, s.tuned("index_merge")) == ("ice[answer_spans=4,index_merge=mass]", "ice", 4, "mass")
    assert parse_variant("ice", cpu_settings) == ("ice", "ice", cpu_settings)
    for bad, words in (("ice[answer_spans=17]", "answer_spans"), ("ice[nope=2]", "nope"),
                       ("ice[answer_spans]", "key=value"), ("ice[answer_spans=x]", "answer_spans")):
        with pytest.raises(UsageError, match=words):
            parse_variant(bad, cpu_settings)
    with pytest.raises(UsageError, match="brackets"):
        split_methods("ice[answer_spans=4")


def test_bench_decode_refuses_keys_its_methods_share(quick_profile):
    """The model is loaded and prefilled once per run: a variant's weights, dtype or threads
    would be silently ignored, so they are refused before the model loads; so is a label named
    twice (its rows could not be told apart)."""
    from .conftest import run_cli

    for methods, why in (("full,ice[weights=int8]", "weights is the same for every method of a run"),
                         ("ice[cpu_threads=1]", "cpu_threads is the same for every method"),
                         ("full,ice,full", "'full' is named twice"), ("full,nope", "nope")):
        bad = run_cli(["bench", "decode", "--ctx", "300", "--methods", methods, "--profile", quick_profile])
        assert bad.returncode == 2, (methods, bad.stderr.decode())
        assert why in bad.stderr.decode() and "Traceback" not in bad.stderr.decode(), methods


@pytest.mark.parametrize("rounds", [pytest.param("1", marks=pytest.mark.slow), "2"])  # (one of them, 27 s, in the default suite)
def test_bench_decode_command_rounds(rounds, quick_profile):
    """`icecache bench decode --rounds`: one method after the other (1) or taking turns (2);
    either way a row per method, ratios to the first."""
    import json

    from .conftest import run_cli

    extra = ["--time-linears"] if rounds == "2" else []
    r = run_cli(["bench", "decode", "--ctx", "300", "--methods", "full,ice[carry_pages=8]", "--decode-steps", "3",
                 "--rounds", rounds, "--budget", "64", "--json", "--profile", quick_profile] + extra)
    assert r.returncode == 0, r.stderr.decode()
    rows = json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]
    assert [x["method"] for x in rows] == ["full", "ice[carry_pages=8]"]
    assert all(x["tpot_ms"] > 0 and x["ctx"] == 300 for x in rows)
    assert rows[0]["tpot_ratio_vs_full"] == 1.0 and rows[1]["host_kv_bytes"] > 0
    assert ("interleaved rounds" in r.stderr.decode()) == (rounds == "2")
    assert all(("linears" in x["breakdown_ms"]) == bool(extra) for x in rows)


def test_the_bench_plans_a_run_for_the_tokens_it_decodes(loaded, cpu_settings):
    """A timed session is planned as a user's run of prompt + decoded tokens: ``dense_until``
    (and ``positions: auto``) see the steps too, not the prompt alone."""
    from icecache.bench import decode_bench

    settings = cpu_settings.replace(dense_until=305, prefill="auto", positions="auto")
    shared = decode_bench.prefill(loaded, settings, 300)
    fits = decode_bench.start(loaded, settings, "ice", shared, warmup=2, steps=2)  # 300 + 5
    assert fits.session.all_dense and fits.session.new_tokens == 5
    over = decode_bench.start(loaded, settings, "ice", shared, warmup=2, steps=3)  # 300 + 6
    assert not over.session.all_dense and over.session.cache.stats.steps > 0


def test_the_linear_clock_times_the_decode_steps_joined_int4_products(monkeypatch):
    """The fast step's joined int4 products call no module, so no hook sees them: the clock
    times them itself while entered, and puts the product back after."""
    import time

    import torch

    from icecache.bench import decode_bench
    from icecache.fast_step import Int4Layer

    def slow(x, joined):
        time.sleep(0.002)
        return x

    monkeypatch.setattr(Int4Layer, "product_of", staticmethod(slow))
    with decode_bench.LinearClock(torch.nn.Sequential()) as clock:
        assert Int4Layer.product_of(1, None) == 1 and Int4Layer.product_of(2, None) == 2
    assert clock.seconds >= 0.004
    assert Int4Layer.product_of is slow  # (a staticmethod reads back as the function)
    timed = clock.seconds
    Int4Layer.product_of(3, None)
    assert clock.seconds == timed  # not timed after the clock is left


def test_breakdown_is_of_the_median_step_not_of_a_spike(loaded, cpu_settings):
    """A step that spends a second in one stage (an eviction into the index) moves no part of
    the breakdown by more than it moves the median TPOT: each part is a median over the steps,
    the rest a median of each step's time less its stages (a mean of the stages beside the
    median TPOT gave the spike to the attention and a negative rest)."""
    settings = cpu_settings.replace(budget=64)
    shared = decode_bench.prefill(loaded, settings, 300)
    t = decode_bench.start(loaded, settings, "ice", shared)
    t.advance(6)
    assert len(t.stages) == len(t.times) == 6
    before = t.result().breakdown_ms
    t.times.append(1.0)
    t.stages.append((0.0, 0.0, 0.99))
    r = t.result()
    b = r.breakdown_ms
    assert 0 < b["rest_of_model"] <= r.tpot_ms and b["ice_attention"] <= r.tpot_ms
    for name in ("index_query", "page_loading", "ice_attention", "rest_of_model"):
        assert b[name] == pytest.approx(before[name], abs=1000 * max(t.times[:6]))
    assert sum(b.values()) == pytest.approx(r.tpot_ms, rel=0.5)
    # the mean step counts the spike, as a long generation does; the median does not
    assert r.tpot_mean_ms == pytest.approx(1000 * sum(t.times) / 7)
    assert r.tpot_ms <= 1000 * max(t.times[:6]) < r.tpot_mean_ms
