"""``dense_until``: a short ice run keeps every layer dense (exact attention, no pages)."""

from __future__ import annotations

from .test_positions import ROPES, llama


def test_the_choice_of_an_all_dense_run():
    from icecache.methods import all_dense

    from .lab import lab_settings

    model = llama(ROPES["default"])  # trained on 4096 positions
    s = lab_settings(prefill="auto", positions="auto", max_context=10**6, dense_until=2048)
    assert all_dense("ice", model, s, 2048) and all_dense("ice-reuse", model, s, 100)
    assert not all_dense("ice", model, s, 2049)  # past dense_until
    assert not all_dense("ice", model, s, 0)  # the run's length not known
    for method in ("quest", "streaming", "snapkv", "full", "dense", "oracle"):
        assert not all_dense(method, model, s, 1000), method  # baselines run as themselves
    assert not all_dense("ice", model, s.replace(dense_until=0), 1000)  # off
    assert not all_dense("ice", model, s.replace(prefill="sparse"), 1000)  # asked for a sparse prefill
    assert not all_dense("ice", model, s.replace(positions="remap"), 1000)  # remapped positions
    assert all_dense("ice", model, s.replace(prefill="full", positions="true"), 1000)
    wide = s.replace(dense_until=100_000)
    assert all_dense("ice", model, wide, 4096)
    assert not all_dense("ice", model, wide, 4097)  # past the trained context: remap and a sparse prefill


def test_make_cache_keeps_every_layer_dense_for_a_short_run():
    from icecache.cache import IceCache
    from icecache.cache.dense import GrowingLayer
    from icecache.cache.ice_layer import IceLayer
    from icecache.methods import make_cache

    from .lab import lab_settings

    model = llama(ROPES["default"])
    s = lab_settings(prefill="full", positions="true", max_context=10**5, dense_layers=1, dense_until=512)
    short = make_cache("ice", model, s, 512)
    assert isinstance(short, IceCache) and short.all_dense
    assert all(isinstance(layer, GrowingLayer) for layer in short.layers)
    long = make_cache("ice", model, s, 513)
    assert not long.all_dense and isinstance(long.layers[1], IceLayer)
    assert not make_cache("quest", model, s, 100).all_dense


def test_a_short_ice_run_decodes_as_full_attention_and_a_longer_one_pages(loaded, cpu_settings):
    """Within ``dense_until`` ice attends to every token: the greedy tokens of full attention.
    A longer prompt over the same session (a cropped cache would stay dense) gets a paged cache."""
    from icecache.generation import Session

    text = " ".join(f"Line {i}: the crane lifted crate {i * 13 % 97} onto the quay." for i in range(60))
    ids = loaded.tokenizer(text)["input_ids"]
    short = ids[:300]
    settings = cpu_settings.replace(dense_until=400, prefill="auto", positions="auto")
    ref, _ = Session(loaded, settings, "full").generate(short, 12)
    s = Session(loaded, settings, "ice")
    got, _ = s.generate(short, 12)
    assert s.all_dense and s.cache.stats.steps == 0  # no page was ever selected
    assert got == ref
    paged = Session(loaded, settings.replace(dense_until=0), "ice")
    paged.generate(short, 4)
    assert not paged.all_dense and paged.cache.stats.steps > 0
    longer = ids[:600]  # shares the first 300 tokens with the cached prompt
    out, _ = s.generate(longer, 4)
    assert not s.all_dense and s.cache.stats.steps > 0 and len(out) == 4


def test_the_command_line_says_a_short_run_is_dense_and_warns_of_an_unused_budget(quick_profile):
    from .conftest import EXAMPLE, run_cli

    r = run_cli(["summarize", str(EXAMPLE), "--max-new-tokens", "2", "--budget", "64", "--stats"], stdin=None)
    err = r.stderr.decode()
    assert r.returncode == 0, err[-2000:]
    assert "every layer dense (the run fits dense_until, 9216 tokens; float16 keys, bfloat16 values)" in err
    assert err.count("--budget 64 has no effect on this run") == 1 and "all_dense=True" in err
    paged = run_cli(["summarize", str(EXAMPLE), "--max-new-tokens", "2", "--budget", "64", "--stats",
                     "--profile", quick_profile], stdin=None)  # dense_until: 0
    err = paged.stderr.decode()
    assert paged.returncode == 0 and "every layer dense" not in err and "has no effect" not in err
    assert "all_dense=False" in err and "pages_selected_per_step" in err


def test_bench_rows_say_a_dense_run():
    import json

    from .conftest import run_cli

    r = run_cli(["bench", "--ctx", "300", "--methods", "full,ice", "--decode-steps", "2", "--json"])
    err = r.stderr.decode()
    assert r.returncode == 0, err[-2000:]
    rows = json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]
    assert [(x["method"], x["all_dense"]) for x in rows] == [("full", False), ("ice", True)]
    assert "ice at 300 tokens (true positions, every layer dense: within dense_until)" in err
    table = [line.split() for line in err.splitlines()  # the table's rows, not the status lines
             if line.startswith(("full ", "ice ")) and " tokens" not in line]
    assert [(row[0], "dense" in row) for row in table] == [("full", False), ("ice", True)]
