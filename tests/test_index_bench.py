"""The index benchmark's pieces: Quest scoring, size parsing, and a small real-key run."""

from __future__ import annotations

import numpy as np
import pytest

from icecache.bench.index_bench import IndexBenchResult, quest_pages, run_layer
from icecache.errors import UsageError
from icecache.index import IndexConfig
from icecache_cli.bench import parse_size


def test_quest_pages_by_bound():
    keys = np.array([[1, 0], [2, 0], [0, 5], [0, -5], [-3, 1], [-1, 1]], np.float32)
    # pages of 2: [0,1] bound for q=(1,1): max(1,2)+0 = 2; [2,3]: 0 + 5 = 5; [4,5]: -1 + 1 = 0
    assert quest_pages(keys, np.array([1, 1], np.float32), 2, 3).tolist() == [1, 0, 2]
    # a partial last page is a page too
    assert quest_pages(keys[:5], np.array([-1, 0], np.float32), 2, 1).tolist() == [2]


def test_parse_size():
    assert parse_size("8k") == 8192 and parse_size("128K") == 131072 and parse_size("500") == 500
    with pytest.raises(UsageError):
        parse_size("lots")


def test_small_run_on_real_keys(loaded):
    from icecache.bench.capture import capture

    cap = capture(loaded, 512, [2, 10], num_queries=3, chunk=256)
    assert cap.keys[2].shape == (3, 512, 64) and cap.queries[10].shape == (9, 3, 64)
    res = IndexBenchResult(keys=512, budgets=[64, 128])
    for layer in cap.layers:
        run_layer(res, cap.keys[layer], cap.queries[layer], 16, 2, 2, IndexConfig(ratio_bottom=0.1))
    for budget in (64, 128):
        t = {m: np.array(v) for m, v in res.mass[budget].items()}
        # the budget's tokens by the group's summed weight over every key hold the most a
        # shared selection can (on the group's average): token picks and merged pages included
        assert len(t["ice_pick"]) == len(t["exact_gqa"]) == len(t["ice"])
        assert t["exact_gqa"].mean() >= max(t["ice_pick"].mean(), t["ice_gqa"].mean()) - 1e-9
        assert ((t["sink_window"] > 0) & (t["ice"] <= 1 + 1e-6)).all()
        assert (t["ice"] >= t["sink_window"] - 1e-9).all()
        # No selection of at most `budget` tokens beats the exact top tokens of that head.
        assert (t["exact_topk"] >= t["ice"] - 1e-6).all() and (t["exact_topk"] >= t["quest"] - 1e-6).all()
        for name in ("kmeans_pages", "parent_pages", "kmeans_gqa"):  # the yardsticks, same rule
            assert len(t[name]) == len(t["ice"]) and (t["exact_topk"] >= t[name] - 1e-6).all()
    assert np.mean(res.mass[128]["ice"]) >= np.mean(res.mass[64]["ice"])
    s = res.summary(128)
    assert 0 <= s["recall_at_64"] <= 1 and s["build_us_per_key"] > 0
    assert set(s["page_fill"]) == {"tree", "kmeans", "parent"} and all(0 < v <= 1 for v in s["page_fill"].values())


def test_capture_chunked_prefill_equals_one_shot(loaded):
    """Chunks over a growing cache give the one-shot keys and queries (the masks are right)."""
    from icecache.bench.capture import capture

    a = capture(loaded, 600, [2, 20], num_queries=4, chunk=256)
    b = capture(loaded, 600, [2, 20], num_queries=4, chunk=1024)
    for layer in (2, 20):
        np.testing.assert_allclose(a.keys[layer], b.keys[layer], atol=1e-4)
        np.testing.assert_allclose(a.queries[layer], b.queries[layer], atol=1e-4)
    # Past exact_max: independent chunks (with the sink prefix), same shapes; the first chunk's
    # keys are those of the real prefill.
    c = capture(loaded, 600, [2], num_queries=4, chunk=256, exact_max=300)
    assert c.keys[2].shape == a.keys[2].shape and c.queries[2].shape == a.queries[2].shape
    np.testing.assert_allclose(c.keys[2][:, :256], a.keys[2][:, :256], atol=1e-4)
    assert not np.allclose(c.keys[2][:, 300:], a.keys[2][:, 300:], atol=1e-3)


def test_groupings_pages_are_bounded_and_exact():
    from icecache.bench import groupings as g

    rng = np.random.default_rng(4)
    keys = rng.standard_normal((700, 8)).astype(np.float32)
    rows = g.mips_rows(keys)
    # the transform: every row has the same norm, and inner products with [q, 0] are kept
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), np.linalg.norm(rows[0]), rtol=1e-5)
    q = rng.standard_normal(8).astype(np.float32)
    np.testing.assert_allclose(rows[:, :8] @ q, keys @ q, rtol=1e-5)
    for page_of in (g.kmeans_pages(rows, 16), g.nearest_parent_pages(rows, 16, 16)):
        sizes = np.bincount(page_of)
        assert len(page_of) == 700 and sizes.min() >= 1 and sizes.max() <= 16  # no empty, none over
        assert 0 < g.page_fill(page_of, 16) <= 1
    # nearest-parent groups: each key sits with its exact best parent (one parent per group)
    labels = np.argmax(rows @ rows[::16].T, axis=1)
    page_of = g.nearest_parent_pages(rows, 16, 16)
    for page in range(page_of.max() + 1):
        assert len(set(labels[page_of == page].tolist())) == 1
    # a group of 40 is cut into 3 runs of 13-14, in direction order
    cut = g.cut_into_pages(np.zeros(40, np.int64), 16, np.arange(40.0)[::-1])
    assert sorted(np.bincount(cut).tolist()) == [13, 13, 14] and cut[39] == 0


def test_kmeans_lowers_its_objective_and_oracle_pages_rank_by_best_member():
    from icecache.bench import groupings as g

    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(c, 0.1, (50, 3)) for c in (-3, 0, 3)]).astype(np.float32)

    def objective(labels):
        return sum(((x[labels == j] - x[labels == j].mean(0)) ** 2).sum() for j in np.unique(labels))

    one, ten = g.kmeans_labels(x, 3, iters=1, seed=1), g.kmeans_labels(x, 3, iters=10, seed=1)
    assert objective(ten) <= objective(one) + 1e-6
    assert objective(ten) < 0.05 * objective(np.zeros(150, np.int64))  # the three blobs found
    page_of = np.array([0, 0, 1, 1, 2, 2])
    scores = np.array([1.0, 5.0, 4.0, 4.5, -1.0, 6.0])
    assert g.oracle_pages(page_of, scores, 2).tolist() == [2, 0]


@pytest.mark.slow  # (a measurement command end to end, 34 s; its parts are tested above)
def test_index_command_measures_each_beam_on_the_same_keys():
    """`bench index --beam A,B`: one summary per beam; the beam share, pages, merge and refinement
    are the cpu profile's unless a flag says otherwise (what a decode step walks)."""
    import json

    from icecache.config import resolve_settings

    from .conftest import run_cli

    args = ["bench", "index", "--keys", "512", "--layers", "2,10", "--queries", "2", "--budgets", "64",
            "--json"]
    r = run_cli([*args, "--beam", "8,16"])
    assert r.returncode == 0, r.stderr.decode()
    docs = [json.loads(x) for x in r.stdout.decode().strip().splitlines()]
    cpu = resolve_settings("cpu")
    frac = cpu.tuned("index_beam_frac")
    assert [(d["config"]["beam"], d["config"]["beam_frac"]) for d in docs] == [(8, frac), (16, frac)]
    assert all((d["config"]["pages"], d["config"]["merge"], d["config"]["refine"], d["config"]["walk_keys"])
               == (cpu.tuned("index_pages"), cpu.tuned("index_merge"), cpu.tuned("index_refine"),
                   cpu.tuned("index_walk_keys")) for d in docs)
    assert all(d["keys"] == 512 and 0 < d["recall_at_64"] <= 1 for d in docs)
    r = run_cli([*args, "--beam-frac", "0.5"])
    assert r.returncode == 0, r.stderr.decode()
    (doc,) = [json.loads(x) for x in r.stdout.decode().strip().splitlines()]
    # the profile's beam is auto: the embedded model's decode steps walk with 32
    assert resolve_settings("cpu").tuned("index_beam") == 0
    assert doc["config"]["beam"] == 32 and doc["config"]["beam_frac"] == 0.5
    bad = run_cli([*args, "--beam", "0"])
    assert bad.returncode == 2 and "--beam: each value must be 1 or more" in bad.stderr.decode()


def test_index_command_refuses_unknown_walk_keys():
    """`bench index --walk-keys`: float32, int8 or both; anything else is a usage error (exit 2)
    before any model loads."""
    from .conftest import run_cli

    bad = run_cli(["bench", "index", "--keys", "512", "--walk-keys", "float32,int4"])
    assert bad.returncode == 2 and "--walk-keys: 'int4' is not one of float32, int8" in bad.stderr.decode()
