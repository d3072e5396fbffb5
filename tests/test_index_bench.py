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
        assert ((t["sink_window"] > 0) & (t["ice"] <= 1 + 1e-6)).all()
        assert (t["ice"] >= t["sink_window"] - 1e-9).all()
        # No selection of at most `budget` tokens beats the exact top tokens of that head.
        assert (t["exact_topk"] >= t["ice"] - 1e-6).all() and (t["exact_topk"] >= t["quest"] - 1e-6).all()
    assert np.mean(res.mass[128]["ice"]) >= np.mean(res.mass[64]["ice"])
    s = res.summary(128)
    assert 0 <= s["recall_at_64"] <= 1 and s["build_us_per_key"] > 0


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
