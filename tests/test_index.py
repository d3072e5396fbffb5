"""The DCI-tree: structural invariants, exactness of the kernels against NumPy references, recall."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icecache.index import DCITree, IndexConfig, kernels, merge_group_pages
from icecache.index.reference import exact_topk, mip_transform, nearest, nearest_inner, ranked_pages


def clustered(n: int, d: int = 16, clusters: int = 12, seed: int = 0, scale: float = 3.0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, d)) * scale
    return (centers[rng.integers(0, clusters, n)] + rng.standard_normal((n, d))).astype(np.float32)


def check_invariants(t: DCITree) -> None:
    n, S = t.n, t.cfg.page_size
    live = t.live_pages()
    seen = np.zeros(n, np.int64)
    for p in live:
        c = t.count[p]
        assert 1 <= c <= S
        for s, i in enumerate(t.members[p, :c]):
            seen[i] += 1
            assert t.tok_page[i] == p and t.tok_slot[i] == s
            assert t.parent[i] == t.owner[p]  # a page holds siblings only
    assert (seen == 1).all(), "every token sits in exactly one page"
    assert t.count[live].sum() == n
    for i in range(n):
        par = t.parent[i]
        if t.level[i] == t.top_level:
            assert par == 0
        else:
            assert par > 0 and t.level[par - 1] > t.level[i]
    # Projection pages: a node's pages are disjoint runs, ordered along the projection; either
    # way each page's range is its members' and the sizes add up.
    ordered = t.cfg.pages == "projection"
    for node in range(n + 1):
        pg, prev_hi, total = t.first_page[node], -np.inf, 0
        while pg >= 0:
            vals = t.proj[t.members[pg, : t.count[pg]]]
            assert t.lo[pg] == vals.min() and t.hi[pg] == vals.max()
            assert not ordered or vals.min() >= prev_hi
            prev_hi, total, pg = vals.max(), total + t.count[pg], t.next_page[pg]
        assert total == t.node_size[node]
    # Every transformed key has squared norm M (the inner-product transform).
    norms = (t.rows(np.arange(n)).astype(np.float64) ** 2).sum(1)
    np.testing.assert_allclose(norms, t.M, rtol=1e-4)


@pytest.mark.parametrize("pages", ["projection", "similar"])
@pytest.mark.parametrize("promotion", ["deterministic", "random"])
def test_build_invariants_and_exact_parents(promotion, pages):
    keys = clustered(3000)
    cfg = IndexConfig(page_size=8, promotion=promotion, ratio_bottom=0.05, ratio_upper=0.25, seed=3, pages=pages)
    t = DCITree(16, cfg)
    dirty = t.insert(keys)
    assert set(dirty.tolist()) == set(t.live_pages().tolist())
    assert t.top_level >= 2
    check_invariants(t)
    # Build-time parents are the exact nearest points one level up (transformed space).
    X = mip_transform(keys.astype(np.float64))
    for lvl in range(t.top_level):
        kids = np.flatnonzero(t.level[: t.n] == lvl)
        ups = np.flatnonzero(t.level[: t.n] == lvl + 1)
        if len(ups) == 0 or len(kids) == 0:
            continue
        ref = ups[nearest(X[kids], X[ups])]
        got = t.parent[kids] - 1
        # Ties/rounding aside, the parent's distance equals the nearest one.
        d_got = ((X[kids] - X[got]) ** 2).sum(1)
        d_ref = ((X[kids] - X[ref]) ** 2).sum(1)
        np.testing.assert_allclose(d_got, d_ref, rtol=1e-4, atol=1e-4)


def test_parents_by_tree_walk_when_the_level_above_is_large():
    """Above ``exact_parent_max`` a batch's parents come from a tree walk: a valid tree whose
    parents are mostly the exact nearest ones (the exact rule is the default up to 16384)."""
    keys = clustered(3000)
    cfg = IndexConfig(page_size=8, ratio_bottom=0.05, ratio_upper=0.25, exact_parent_max=20)
    t = DCITree(16, cfg)
    t.insert(keys)
    check_invariants(t)
    X = mip_transform(keys.astype(np.float64))
    kids, ups = np.flatnonzero(t.level[: t.n] == 0), np.flatnonzero(t.level[: t.n] == 1)
    assert len(ups) > 20  # the walk was taken
    d_got = ((X[kids] - X[t.parent[kids] - 1]) ** 2).sum(1)
    d_ref = ((X[kids] - X[ups[nearest(X[kids], X[ups])]]) ** 2).sum(1)
    assert (d_got >= d_ref - 1e-4).all()
    assert np.mean(np.isclose(d_got, d_ref, rtol=1e-4, atol=1e-4)) > 0.8


def test_deterministic_levels_follow_one_in_n():
    t = DCITree(16, IndexConfig(ratio_bottom=0.01, ratio_upper=0.2))
    t.insert(clustered(5000))
    levels = t.level[: t.n]
    assert (levels >= 1).sum() == 50 and (levels >= 2).sum() == 10 and (levels >= 3).sum() == 2


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    batches=st.lists(st.integers(1, 40), min_size=5, max_size=60),
    growth=st.floats(1.0, 1.5),
    promotion=st.sampled_from(["deterministic", "random"]),
    pages=st.sampled_from(["projection", "similar"]),
)
def test_invariants_after_random_inserts(seed, batches, growth, promotion, pages):
    cfg = IndexConfig(page_size=4, ratio_bottom=0.1, ratio_upper=0.3, promotion=promotion, seed=seed, pages=pages)
    t = DCITree(8, cfg)
    rng = np.random.default_rng(seed)
    t.insert(clustered(200, d=8, seed=seed))
    scale = 1.0
    for b in batches:
        scale *= growth  # growing norms: M rises and the extra coordinate is corrected
        before = {p: t.page_tokens(p).tolist() for p in t.live_pages()}
        new = t.n + np.arange(b)
        dirty = set(t.insert((rng.standard_normal((b, 8)) * scale).astype(np.float32)).tolist())
        assert {int(t.tok_page[i]) for i in new} <= dirty  # pages that took new keys are dirty
        for p in t.live_pages():  # any page whose content changed is reported
            if before.get(int(p)) != t.page_tokens(p).tolist():
                assert int(p) in dirty
    check_invariants(t)


def test_search_with_full_beam_is_exact():
    keys = clustered(2000, seed=5)
    t = DCITree(16, IndexConfig(page_size=8, beam=10_000, ratio_bottom=0.05))
    t.insert(keys)
    queries = clustered(6, seed=9)
    ids, scores = t.search(queries, 32)
    for r, q in enumerate(queries):
        ref = exact_topk(keys, q, 32)
        assert set(ids[r].tolist()) == set(ref.tolist())
        np.testing.assert_allclose(scores[r], keys[ids[r]] @ q, rtol=1e-4, atol=1e-3)
        assert (np.diff(scores[r]) <= 1e-5).all()  # best first


def test_recall_on_clustered_data():
    keys = clustered(20_000, d=32, clusters=64, seed=1)
    t = DCITree(32)
    t.insert(keys)
    queries = clustered(20, d=32, clusters=64, seed=2)
    ids, _ = t.search(queries, 64)
    recall = np.mean([len(set(ids[r]) & set(exact_topk(keys, q, 64))) / 64 for r, q in enumerate(queries)])
    assert recall >= 0.9


def test_fixed_seed_same_result():
    keys = clustered(3000, seed=4)
    q = clustered(4, seed=8)
    outs = []
    for _ in range(2):
        t = DCITree(16, IndexConfig(promotion="random", seed=11))
        t.insert(keys[:2000])
        t.insert(keys[2000:])
        outs.append((t.search(q, 16)[0], t.parent[: t.n].copy(), t.tok_page[: t.n].copy()))
    for a, b in zip(outs[0], outs[1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_topk_kernel_matches_argsort():
    """Exactly the stable argsort's first k (ties by index), on ties, runs of similar scores (as
    the walk scans them), wide and overflowing ranges, and non-finite scores."""
    rng = np.random.default_rng(0)
    cases = [rng.integers(0, 20, n).astype(np.float32) for n in (10, 100, 1000, 50)]  # many ties
    cases += [np.repeat(rng.standard_normal(300), rng.integers(1, 40, 300)).astype(np.float32),
              np.sort(rng.standard_normal(5000)).astype(np.float32),
              (rng.standard_normal(3000) * 1e38).astype(np.float32),
              np.full(64, 2.5, np.float32), np.float32([1e-30, 0.0, -1e-30] * 30),
              np.float32([3.0, np.inf, -np.inf, 1.0, np.inf, 0.0, 7.0] * 20)]
    big = rng.standard_normal(4000).astype(np.float32)
    big[::7] = big.max()  # the largest score many times over: one bucket holds more than k
    cases.append(big)
    for s in cases:
        for k in (0, 1, 3, 17, 60, 100, 256, len(s) - 1, len(s), len(s) + 5):
            if k < 0:
                continue
            got = kernels.topk_indices(s, k)
            np.testing.assert_array_equal(got, np.argsort(-s, kind="stable")[:k])


def test_kth_largest_and_top_rows_match_sorting():
    """``kth_largest`` (bit histograms) is exactly the sorted weights' k-th largest, and
    ``top_rows`` the ids of ``top_tokens``' choice (ties at the cut: the earliest rows), on
    zeros, ties, tiny and huge weights; every k."""
    from icecache.cache.selectors.tokens import top_tokens

    rng = np.random.default_rng(5)
    cases = [rng.exponential(size=n).astype(np.float32) for n in (1, 2, 7, 300)]
    cases += [np.float32([0.0, 1e-38, 1e-45, 3e38, 1.0, 1.0, 0.0, 2.5e-20] * 9),
              np.round(rng.exponential(size=500) * 3).astype(np.float32) / 3,  # many ties
              np.zeros(40, np.float32), (rng.exponential(size=3500) ** 6).astype(np.float32)]
    for w in cases:
        ids = rng.permutation(10 * len(w))[: len(w)].astype(np.int32)
        for k in sorted({1, min(2, len(w)), len(w) // 3 + 1, len(w) // 2 + 1, len(w)}):
            assert kernels.kth_largest(w, k) == np.sort(w)[-k]
            np.testing.assert_array_equal(kernels.top_rows(w, ids, k), ids[top_tokens(w.astype(np.float64), k)])
        np.testing.assert_array_equal(kernels.top_rows(w, ids, len(w) + 3), ids)


def test_ranked_pages_kernel_matches_reference():
    rng = np.random.default_rng(1)
    tok_page = rng.integers(0, 30, 500).astype(np.int32)
    ids = rng.permutation(500)[:200].astype(np.int32)
    for cap in (1, 5, 12, 100):
        assert kernels.ranked_pages(ids, tok_page, cap).tolist() == ranked_pages(ids, tok_page, cap)


def test_merge_ranked_kernel_matches_reference():
    rng = np.random.default_rng(2)
    for _ in range(50):
        g, width = rng.integers(1, 6), rng.integers(1, 9)
        lists = rng.integers(0, 12, (g, width)).astype(np.int32)
        lens = rng.integers(0, width + 1, g).astype(np.int64)
        cap = int(rng.integers(1, 12))
        ref = merge_group_pages([lists[r, : lens[r]] for r in range(g)], cap)
        assert kernels.merge_ranked(lists, lens, cap).tolist() == ref.tolist()


def test_nearest_among_kernel_matches_reference():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((40, 9)).astype(np.float32)
    C = rng.standard_normal((25, 9)).astype(np.float32)
    cand = rng.permutation(100)[:25].astype(np.int32)
    # the candidates' keys where pages hold them: 7 pages of 4 slots, scattered
    PX = rng.standard_normal((7, 4, 9)).astype(np.float32)
    tok_page = np.full(100, -1, np.int32)
    tok_slot = np.full(100, -1, np.int32)
    for i, (c, at) in enumerate(zip(cand, rng.permutation(28)[:25], strict=True)):
        pg, s = divmod(int(at), 4)
        tok_page[c], tok_slot[c] = pg, s
        PX[pg, s] = C[i]
    out = np.empty(40, np.int32)
    kernels.nearest_among(rows, PX, tok_page, tok_slot, cand, out)
    np.testing.assert_array_equal(out, nearest_inner(rows, C, cand))


def test_gqa_merge_rank_by_rank():
    lists = [np.array([5, 1, 9]), np.array([5, 2, 7, 8]), np.array([3, 1])]
    assert merge_group_pages(lists, 10).tolist() == [5, 3, 1, 2, 9, 7, 8]
    assert merge_group_pages(lists, 3).tolist() == [5, 3, 1]
    assert merge_group_pages([], 4).tolist() == []


def test_group_walk_exact_with_full_beam_and_no_worse_recall():
    keys = clustered(2000, seed=5)
    t = DCITree(16, IndexConfig(page_size=8, beam=10_000, ratio_bottom=0.05))
    t.insert(keys)
    queries = clustered(3, seed=9)
    ids, scores = t.search_group(queries, 32)
    for r, q in enumerate(queries):
        assert set(ids[r].tolist()) == set(exact_topk(keys, q, 32).tolist())
        np.testing.assert_allclose(scores[r], keys[ids[r]] @ q, rtol=1e-4, atol=1e-3)
    # A narrow beam: walking the union of the group's beams finds more of the true top keys.
    keys = clustered(20_000, d=32, clusters=64, seed=1)
    t = DCITree(32, IndexConfig(beam=8, beam_frac=0.0))
    t.insert(keys)
    queries = clustered(30, d=32, clusters=64, seed=2)
    solo, group = [], []
    for lo in range(0, 30, 3):
        qs = queries[lo : lo + 3]
        ids_solo, ids_group = t.search(qs, 64)[0], t.search_group(qs, 64)[0]
        for r, q in enumerate(qs):
            ref = set(exact_topk(keys, q, 64).tolist())
            solo.append(len(set(ids_solo[r].tolist()) & ref) / 64)
            group.append(len(set(ids_group[r].tolist()) & ref) / 64)
    assert np.mean(group) > np.mean(solo)  # measured: 0.49 vs 0.33


def test_select_group_merges_per_query_pages():
    keys = clustered(3000, seed=6)
    queries = clustered(3, seed=10)
    for shared in (True, False):
        t = DCITree(16, IndexConfig(page_size=8, beam=10_000, shared_walk=shared))
        t.insert(keys)
        got = t.select_group(queries, 64, 6)
        ref = merge_group_pages(
            [ranked_pages(exact_topk(keys, q, 64).astype(np.int32), t.tok_page, 6) for q in queries], 6)
        assert got.tolist() == ref.tolist()


def narrow_trees():
    """Three narrow-beam trees (one per KV head) on clustered keys, a group of 3 queries each,
    and per head each query's exact ranked pages (8 of 16 keys)."""
    trees, lists = [], []
    queries = np.stack([clustered(3, d=32, clusters=40, seed=20 + h) for h in range(3)])
    for h in range(3):
        keys = clustered(8000, d=32, clusters=40, seed=10 + h)
        t = DCITree(32, IndexConfig(page_size=16, beam=4, beam_frac=0.0))
        t.insert(keys)
        trees.append(t)
        lists.append([ranked_pages(exact_topk(keys, q, 128).astype(np.int32), t.tok_page, 8) for q in queries[h]])
    return trees, queries, lists


def test_a_wide_search_is_exact_on_a_narrow_tree():
    """``wide=1`` (the sparse prefill's prompt-end steps) makes a narrow-beam tree's selection
    the exact one, per tree and through the layer's parallel walk; without it the narrow beam
    misses pages on these keys (so the test can tell the two apart)."""
    from icecache.index.walk import select_layer

    trees, queries, lists = narrow_trees()
    refs, narrow = [merge_group_pages(per_query, 8) for per_query in lists], []
    for h, t in enumerate(trees):
        assert t.beam_for(1.0) >= t.n and t.beam_for(0.0) == 4
        assert t.select_group(queries[h], 128, 8, 1.0).tolist() == refs[h].tolist()
        narrow.append(t.select_group(queries[h], 128, 8).tolist() == refs[h].tolist())
    assert not all(narrow)
    got = select_layer(trees, queries, 128, 8, 1.0)
    assert [g.tolist() for g in got] == [r.tolist() for r in refs]


def test_extra_pages_are_ranked_with_the_walks_pages():
    """``extra`` pages (``carry_pages``: the previous step's choice) compete with what a narrow
    walk reaches: given each query's exact best pages as extras, the narrow tree's selection is
    the exact one, per tree and through the layer's parallel walk; pages that rank low change
    nothing, and a duplicated or retired extra is harmless."""
    from icecache.index.walk import select_layer

    trees, queries, lists = narrow_trees()
    refs = [merge_group_pages(per_query, 8) for per_query in lists]
    extras = [np.concatenate(per_query) for per_query in lists]  # duplicates across the queries' lists
    narrow = []
    for h, t in enumerate(trees):
        plain = t.select_group(queries[h], 128, 8)
        narrow.append(plain.tolist() == refs[h].tolist())
        assert t.select_group(queries[h], 128, 8, extra=extras[h]).tolist() == refs[h].tolist()
        # the worst-scoring live pages as extras: the narrow walk's own choice is kept
        live = t.live_pages()
        worst = live[np.argsort([t.rows(t.page_tokens(p))[:, :32].dot(queries[h].T).max() for p in live])[:8]]
        retired = np.array([t.pcap - 1], np.int32)  # never filled: owner -1
        assert t.select_group(queries[h], 128, 8, extra=np.concatenate([worst, retired])).tolist() == plain.tolist()
    assert not all(narrow)  # without the extras the narrow beam misses pages here
    got = select_layer(trees, queries, 128, 8, extra=extras)
    assert [g.tolist() for g in got] == [r.tolist() for r in refs]
    with pytest.raises(ValueError, match="page path"):
        trees[0].select_group(queries[0], 64, 8, extra=extras[0])


def test_best_pages_path_equals_ranking_the_top_points():
    """The page path of the group selection (best member per page) picks the same pages, in the
    same order, as ranking the group's top max_pages x page_size points, call after call."""
    keys = clustered(6000, d=32, clusters=40, seed=3)
    t = DCITree(32, IndexConfig(page_size=16, beam=6, beam_frac=0.0))
    t.insert(keys)
    queries = clustered(12, d=32, clusters=40, seed=4)
    for lo in range(0, 12, 3):
        qs = queries[lo : lo + 3]
        for pages in (1, 4, 16):
            ids, _ = t.search_group(qs, pages * 16)
            ref = kernels.group_pages(ids, t.tok_page, pages)
            for _ in range(2):  # a second call: fresh marks
                assert t.select_group(qs, pages * 16, pages).tolist() == ref.tolist()
    t.insert(clustered(500, d=32, clusters=40, seed=8))  # more pages: the scratch grows
    ids, _ = t.search_group(queries[:3], 64)
    assert t.select_group(queries[:3], 64, 4).tolist() == kernels.group_pages(ids, t.tok_page, 4).tolist()


@pytest.mark.parametrize("n", [5, 20, 48, 64])
def test_small_first_insert_point_by_point_has_room_for_its_pages(n):
    """A first batch of <= 64 points goes in point by point: splits of pages of 4 leave pages
    half full, so it needs more pages than ceil(n / page_size) (it once wrote past the end)."""
    for seed in range(5):
        t = DCITree(16, IndexConfig(page_size=4, ratio_bottom=0.1), capacity=max(16, n + 16))
        t.insert(np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32))
        assert t.npages <= t.pcap
        check_invariants(t)


def test_group_walk_scratch_grows_and_is_shared_by_trees(monkeypatch):
    """A walk that outgrows its scratch is redone with more room: the same pages as with room
    to spare; trees share one scratch per thread (a tree holds none of its own)."""
    from icecache.index import walk as walk_mod

    keys = clustered(20000)
    queries = np.random.default_rng(5).standard_normal((3, 16)).astype(np.float32)
    a = DCITree(16, IndexConfig(page_size=8, beam=4, beam_frac=0.0))
    a.insert(keys)
    b = DCITree(16, IndexConfig(page_size=8, beam=4, beam_frac=0.0))
    b.insert(keys[::-1].copy())
    want_a = a.select_group(queries, 64, 8)
    want_b = b.select_group(queries, 64, 8)
    ids_a, sc_a = a.search_group(queries, 40)
    walk_mod._scratch.arrays = {}  # a fresh, small scratch: the first walks overflow it
    monkeypatch.setattr(walk_mod, "WALK_ROWS", 4)
    monkeypatch.setattr(walk_mod, "WALK_ROWS_PER_BEAM", 1)
    calls = []
    real = walk_mod.group_scratch
    monkeypatch.setattr(walk_mod, "group_scratch", lambda n, g, rows: calls.append(rows) or real(n, g, rows))
    np.testing.assert_array_equal(a.select_group(queries, 64, 8), want_a)
    assert len(calls) > 1 and calls == sorted(calls)  # grown, then done
    np.testing.assert_array_equal(b.select_group(queries, 64, 8), want_b)
    got_ids, got_sc = a.search_group(queries, 40)
    np.testing.assert_array_equal(got_ids, ids_a)
    assert not hasattr(a, "_gscr")
    assert walk_mod._scratch.arrays[("mark", 0)].shape[0] >= a.n + 1


def test_select_layer_equals_per_tree_selection(monkeypatch):
    """A layer's heads walked in parallel by one numba call pick what each tree picks alone
    (pages, and the token picks of ``pick_layer``), call after call, also when a head's scratch
    is too short (it is redone alone) and when the trees are of different sizes."""
    from icecache.index import walk as walk_mod

    trees = []
    for h, n in enumerate((4000, 2500, 6000)):
        t = DCITree(16, IndexConfig(page_size=8, beam=5, beam_frac=0.0))
        t.insert(clustered(n, seed=20 + h))
        trees.append(t)
    queries = np.stack([clustered(3, seed=30 + h) for h in range(3)])  # (H, G, d)
    for pages in (2, 6):
        want = [t.select_group(queries[h], pages * 8, pages) for h, t in enumerate(trees)]
        for _ in range(2):
            got = walk_mod.select_layer(trees, queries, pages * 8, pages)
            assert [g.tolist() for g in got] == [w.tolist() for w in want]
        picked = [t.pick_group(queries[h], pages * 5, pages) for h, t in enumerate(trees)]
        got_pages, got_tokens = walk_mod.pick_layer(trees, queries, pages * 5, pages)
        assert [g.tolist() for g in got_pages] == [w.tolist() for w in want] == [p.tolist() for p, _ in picked]
        assert [g.tolist() for g in got_tokens] == [k.tolist() for _, k in picked]
        assert all(len(k) == pages * 5 for k in got_tokens)
    # small scratch (the kept walks forgotten, so that their scratch is taken anew): the
    # parallel walks overflow and are redone alone
    walk_mod._scratch.arrays = {}
    walk_mod._walks.clear()
    monkeypatch.setattr(walk_mod, "WALK_ROWS", 4)
    monkeypatch.setattr(walk_mod, "WALK_ROWS_PER_BEAM", 1)
    alone, redone = walk_mod._alone, []
    monkeypatch.setattr(walk_mod, "_alone", lambda tree, *a: redone.append(tree) or alone(tree, *a))
    got = walk_mod.select_layer(trees, queries, 48, 6)
    want = [t.select_group(queries[h], 48, 6) for h, t in enumerate(trees)]
    assert [g.tolist() for g in got] == [w.tolist() for w in want] and redone
    redone.clear()
    pages, tokens = walk_mod.pick_layer(trees, queries, 40, 6)  # and the token picks, redone alone
    want = [t.pick_group(queries[h], 40, 6) for h, t in enumerate(trees)]
    assert [(p.tolist(), k.tolist()) for p, k in zip(pages, tokens, strict=True)] == [
        (p.tolist(), k.tolist()) for p, k in want] and redone


def test_a_layer_walk_marks_the_current_mark_arrays():
    """A layer's walk keeps its scratch from call to call, but not past a replaced array: when
    another walk grows a head's node marks, the next call stamps the new array (the token
    packing reads this thread's current marks after the walk, ``DCISelector.choose``)."""
    from icecache.index import walk as walk_mod

    trees = []
    for h in range(2):
        t = DCITree(16, IndexConfig(page_size=8, beam=5, beam_frac=0.0))
        t.insert(clustered(1500, seed=40 + h))
        trees.append(t)
    queries = np.stack([clustered(3, seed=50 + h) for h in range(2)])
    walk_mod.select_layer(trees, queries, 32, 4)  # its scratch kept
    for h in range(2):
        before = walk_mod.marks(trees[h].n, h)
        grown = walk_mod.marks(before.shape[0] + 10, h)  # a larger tree's walk needs more
        assert grown is not before
        stamp = grown[0]
        walk_mod.select_layer(trees, queries, 32, 4)
        assert grown[0] > stamp and walk_mod.marks(trees[h].n, h) is grown


def test_balanced_groups_recover_separated_blobs_within_capacity():
    from icecache.index.kernels.build import balanced_groups

    rng = np.random.default_rng(3)
    centres = np.array([[5, 0, 0], [0, 5, 0], [0, 0, 5]], np.float32)
    truth = np.repeat(np.arange(3), [16, 16, 15])
    rows = (centres[truth] + 0.1 * rng.standard_normal((47, 3))).astype(np.float32)
    order = rng.permutation(47)
    labels = balanced_groups(rows[order], 3, 6)
    assert np.bincount(labels, minlength=3).max() <= 16 and labels.min() >= 0
    for j in range(3):  # each group is one blob
        assert len(set(truth[order][labels == j].tolist())) == 1
    # more rows than one blob holds: capacity wins, every group within ceil(c / k)
    labels = balanced_groups(rows[order][:40], 4, 4)
    assert np.bincount(labels, minlength=4).max() == 10 and np.bincount(labels).sum() == 40


def test_similar_pages_hold_closer_keys_and_search_stays_exact():
    """Similarity pages: the keys of a page are closer together (k-means objective over pages,
    transformed space) than projection pages of the same tree, after a build and inserts; the
    search over them is still exact with a full beam."""
    keys = clustered(4000, d=16, clusters=40, seed=8)

    def spread(t):
        X = t.rows(np.arange(t.n)).astype(np.float64)
        total = 0.0
        for p in t.live_pages():
            rows = X[t.page_tokens(p)]
            total += ((rows - rows.mean(0)) ** 2).sum()
        return total

    trees = {}
    for pages in ("projection", "similar"):
        t = DCITree(16, IndexConfig(page_size=8, ratio_bottom=1 / 32, beam=10_000, pages=pages))
        t.insert(keys[:3000])
        for lo in range(3000, 4000, 8):
            t.insert(keys[lo : lo + 8])
        check_invariants(t)
        trees[pages] = t
    assert spread(trees["similar"]) < 0.9 * spread(trees["projection"])
    queries = clustered(5, d=16, clusters=40, seed=9)
    ids, _ = trees["similar"].search(queries, 24)
    for r, q in enumerate(queries):
        assert set(ids[r].tolist()) == set(exact_topk(keys, q, 24).tolist())


def _two_head_trees(keys, merge: str) -> list:
    """Two KV heads' trees (the second's keys shifted by 0.01) with a beam over every node."""
    trees = []
    for h in range(2):
        t = DCITree(16, IndexConfig(page_size=8, beam=10_000, merge=merge))
        t.insert(keys + 0.01 * h)
        trees.append(t)
    return trees


def test_mass_merge_with_full_beam_equals_the_softmax_page_mass_reference():
    """With a beam over every node the walk scans every key, so the mass merge must pick the
    pages of largest summed softmax mass over the group's queries, computed here in NumPy;
    through ``select_layer`` (heads in parallel) as through one tree."""
    from icecache.index import select_layer

    keys = clustered(2500, d=16, clusters=30, seed=12)
    queries = 3.0 * clustered(3, d=16, clusters=30, seed=13)
    trees = _two_head_trees(keys, "mass")
    for pages in (1, 5, 12):
        for h, t in enumerate(trees):
            s = (queries @ (keys + 0.01 * h).T) / 4.0  # scale 1 / sqrt(16)
            w = np.exp(s - s.max(1, keepdims=True))
            w /= w.sum(1, keepdims=True)
            per_page = np.zeros(t.npages)
            np.add.at(per_page, t.tok_page[: t.n], w.sum(0))
            want = np.argsort(-per_page, kind="stable")[:pages]
            got = t.select_group(queries, pages * 8, pages)
            assert got.tolist() == want.tolist()
        both = select_layer(trees, np.stack([queries, queries]).astype(np.float32), pages * 8, pages)
        assert [b.tolist() for b in both] == [t.select_group(queries, pages * 8, pages).tolist() for t in trees]
    # the ranks merge of the same trees differs (it is the other rule)
    ranks = DCITree(16, IndexConfig(page_size=8, beam=10_000))
    ranks.insert(keys)
    assert ranks.select_group(queries, 40, 5).tolist() != trees[0].select_group(queries, 40, 5).tolist()


def test_the_mass_merges_exponential_matches_numpy():
    """``exp_near`` (the mass merge's vectorized exponential) against NumPy's over its range,
    0 at and below the cut-off, and into a separate output only."""
    from icecache.index.kernels.shared import NEGLIGIBLE, exp_near

    x = np.concatenate([-np.linspace(0, NEGLIGIBLE, 20001, dtype=np.float32),
                        np.float32([-NEGLIGIBLE - 1e-3, -40.0, -1e6])])
    out = np.full_like(x, np.nan)
    exp_near(x, out)
    inside = x > -NEGLIGIBLE
    np.testing.assert_allclose(out[inside], np.exp(x[inside].astype(np.float64)), rtol=1e-5)
    assert np.all(out[~inside] == 0.0) and out[0] == pytest.approx(1.0, abs=1e-6)


def test_peaks_merge_with_full_beam_equals_the_page_peak_reference():
    """The peaks merge ranks pages by each query's softmax over the pages' best scores, summed
    over the group (NumPy reference here, every key scanned by a full beam); through
    ``select_layer`` as through one tree. Every rule of the kernels' codes is a valid
    profile value."""
    from icecache.cache.selectors.dci import DCISettings
    from icecache.index import select_layer
    from icecache.index.config import MERGES

    assert all(DCISettings(index_merge=m).index_merge == m for m in MERGES)
    keys = clustered(2500, d=16, clusters=30, seed=14)
    queries = clustered(3, d=16, clusters=30, seed=15)  # flat enough that peaks and mass differ
    trees = _two_head_trees(keys, "peaks")
    for pages in (1, 5, 12):
        for h, t in enumerate(trees):
            s = (queries @ (keys + 0.01 * h).T) / 4.0  # scale 1 / sqrt(16)
            live = t.live_pages()
            best = np.full((len(queries), t.npages), -np.inf)
            for r in range(len(queries)):
                np.maximum.at(best[r], t.tok_page[: t.n], s[r])
            w = np.exp(best[:, live] - best[:, live].max(1, keepdims=True))
            w /= w.sum(1, keepdims=True)
            want = live[np.argsort(-w.sum(0), kind="stable")[:pages]]
            got = t.select_group(queries, pages * 8, pages)
            assert sorted(got.tolist()) == sorted(want.tolist())
            assert got[0] == want[0]
        both = select_layer(trees, np.stack([queries, queries]).astype(np.float32), pages * 8, pages)
        assert [b.tolist() for b in both] == [t.select_group(queries, pages * 8, pages).tolist() for t in trees]
    # the mass merge of the same keys picks other pages here (it is the other rule)
    mass = _two_head_trees(keys, "mass")[0]
    assert set(mass.select_group(queries, 96, 12).tolist()) != set(trees[0].select_group(queries, 96, 12).tolist())


# -- Lloyd refinement of the bottom level's grouping ---------------------------------------------
def bottom_groups(t: DCITree) -> tuple[np.ndarray, np.ndarray]:
    """Bottom points whose parent is a level-1 point, and those parents (node ids)."""
    pts = np.flatnonzero(t.level[: t.n] == 0)
    par = t.parent[pts]
    ok = (par > 0) & (t.level[np.maximum(par - 1, 0)] == 1)
    return pts[ok], par[ok]


def lloyd_objective(t: DCITree) -> float:
    """Sum of squared distances of bottom points to their parent's children's mean."""
    pts, par = bottom_groups(t)
    X = t.rows(pts).astype(np.float64)
    total = 0.0
    for node in np.unique(par):
        rows = X[par == node]
        total += ((rows - rows.mean(0)) ** 2).sum()
    return total


@pytest.mark.parametrize("pages", ["projection", "similar"])
def test_refinement_never_raises_the_objective_and_keeps_the_tree_whole(pages):
    keys = clustered(3000, d=16, clusters=30, seed=4)
    t = DCITree(16, IndexConfig(page_size=8, ratio_bottom=1 / 16, beam=10_000, pages=pages))
    t.insert(keys)
    costs = [lloyd_objective(t)]
    for _ in range(4):
        t.refine(None, 1)
        check_invariants(t)
        costs.append(lloyd_objective(t))
    assert all(b <= a * (1 + 1e-6) for a, b in zip(costs, costs[1:], strict=False))
    assert costs[-1] < 0.97 * costs[0]  # clustered keys: the nearest parent point is not the best group
    assert t.npages == len(t.live_pages()) + len(t._free)  # no page lost to a refinement
    queries = clustered(4, d=16, clusters=30, seed=5)
    ids, _ = t.search(queries, 20)  # a full beam still finds the exact top keys
    for r, q in enumerate(queries):
        assert set(ids[r].tolist()) == set(exact_topk(keys, q, 20).tolist())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    batches=st.lists(st.integers(1, 60), min_size=5, max_size=40),
    pages=st.sampled_from(["projection", "similar"]),
    refine_min=st.sampled_from([1, 16, 64]),
)
def test_invariants_and_dirty_pages_with_refinement(seed, batches, pages, refine_min):
    cfg = IndexConfig(page_size=4, ratio_bottom=0.1, ratio_upper=0.3, seed=seed, pages=pages, refine=2,
                      refine_candidates=4, refine_min=refine_min)
    t = DCITree(8, cfg)
    rng = np.random.default_rng(seed)
    t.insert(clustered(200, d=8, seed=seed))
    check_invariants(t)
    for b in batches:
        before = {int(p): t.page_tokens(p).tolist() for p in t.live_pages()}
        new = t.n + np.arange(b)
        dirty = set(t.insert(clustered(b, d=8, seed=int(rng.integers(1 << 30)))).tolist())
        assert {int(t.tok_page[i]) for i in new} <= dirty
        live = {int(p) for p in t.live_pages()}
        for p, members in before.items():  # changed or retired since: reported
            if p not in live or members != t.page_tokens(p).tolist():
                assert p in dirty
        check_invariants(t)
    assert t.npages == len(t.live_pages()) + len(t._free)


def test_refinement_kernels_match_numpy():
    from icecache.index.kernels import refine as rk

    rng = np.random.default_rng(2)
    rows = rng.standard_normal((300, 9)).astype(np.float32)
    group = rng.integers(0, 20, 300)
    group[group == 7] = 8  # group 7 has no rows: it keeps its own key
    own = rng.standard_normal((20, 9)).astype(np.float32)
    centres, sizes = rk.group_centres(rows, group, own)
    for g in range(20):
        want = rows[group == g].mean(0) if (group == g).any() else own[g]
        np.testing.assert_allclose(centres[g], want, rtol=1e-5, atol=1e-6)
    assert sizes.tolist() == np.bincount(group, minlength=20).tolist()
    cand = np.stack([rng.choice(20, 5, replace=False) for _ in range(20)])
    cand[:, 0] = np.arange(20)  # each group is its own candidate
    csq = (centres.astype(np.float64) ** 2).sum(1).astype(np.float32)
    out = np.empty(300, np.int64)
    moved = rk.nearest_candidate(rows, group, cand, np.arange(20), centres, csq, out)
    for j in range(300):
        c = cand[group[j]]
        d = ((rows[j].astype(np.float64) - centres[c]) ** 2).sum(1)
        assert d[c.tolist().index(out[j])] <= d.min() + 1e-4
    assert moved == int((out != group).sum())


@pytest.mark.parametrize("pages", ["projection", "similar"])
def test_a_bulk_insert_leaves_room_for_the_first_decode_evictions(monkeypatch, pages):
    """After a build (and a prompt chunk) a tree has room for STEP_RESERVE evicted pages, so the
    first decode steps' inserts copy no arrays (every tree grew there at 8k before); the room
    is exact, not a quarter more; searches are unchanged by it."""
    from icecache.index import tree as tree_mod

    S = 16
    keys = clustered(3000, d=16, seed=3)
    cap = 2500 + 4 * S  # as the cache sizes a build: the prompt's middle and 4 pages
    t = DCITree(16, IndexConfig(page_size=S, pages=pages), capacity=cap)
    t.insert(keys[:2500])
    assert t.pcap - t.npages >= tree_mod.STEP_RESERVE * (S + 1)
    assert t.cap - t.n >= tree_mod.STEP_RESERVE * S
    assert t.pcap <= max(t.npages + tree_mod.STEP_RESERVE * (S + 1), cap * 5 // (4 * S))
    grown = []
    monkeypatch.setattr(tree_mod.DCITree, "_alloc_pages",
                        lambda self, n, _f=tree_mod.DCITree._alloc_pages: (grown.append(n), _f(self, n))[1])
    monkeypatch.setattr(tree_mod.DCITree, "_alloc",
                        lambda self, n, _f=tree_mod.DCITree._alloc: (grown.append(n), _f(self, n))[1])
    for i in range(tree_mod.STEP_RESERVE):
        t.insert(keys[2500 + i * S : 2500 + (i + 1) * S])  # one evicted page, as a decode step sheds it
    assert grown == []
    check_invariants(t)
    q = clustered(4, d=16, seed=9)
    monkeypatch.setattr(tree_mod.DCITree, "_reserve_for_steps", lambda self: None)
    plain = DCITree(16, IndexConfig(page_size=S, pages=pages), capacity=cap)  # without the room
    plain.insert(keys[:2500])
    for i in range(tree_mod.STEP_RESERVE):
        plain.insert(keys[2500 + i * S : 2500 + (i + 1) * S])
    for a, b in zip(t.search(q, 10), plain.search(q, 10), strict=True):
        assert np.array_equal(a, b)


# -- the walks' int8 keys (walk_keys: int8) ---------------------------------------------------


def check_int8_copy(t: DCITree) -> None:
    """Every live page's int8 copy is its float keys rounded: ``step = max |k| / 127`` a key and
    each element within half a step of the key's own (the transform's last coordinate left out)."""
    live = t.live_pages()
    pairs, rows = (t.d + 1) // 2, -(-t.cfg.page_size // 8) * 8
    assert t.K8.shape == (t.pcap, pairs, rows, 2) and t.K8_steps.shape == (t.pcap, t.cfg.page_size)
    for p in live:
        c = t.count[p]
        keys = t.PX[p, :c, : t.d].astype(np.float64)
        steps = t.K8_steps[p, :c].astype(np.float64)
        top = np.abs(keys).max(1)
        np.testing.assert_allclose(steps, np.where(top > 0, top / 127, 1.0), rtol=1e-6)
        # coordinate j of slot s at K8[p, j // 2, s, j % 2]; an odd head_dim's last pair ends in 0
        by_slot = t.K8[p].transpose(1, 0, 2).reshape(rows, 2 * pairs)
        assert (by_slot[:c, t.d:] == 0).all()
        err = np.abs(by_slot[:c, : t.d].astype(np.float64) * steps[:, None] - keys)
        assert (err <= steps[:, None] * (0.5 + 1e-5)).all()
        np.testing.assert_array_equal(t.walk_rows(t.members[p, :c]), by_slot[:c, : t.d] * steps[:, None])


@pytest.mark.parametrize("pages", ["projection", "similar"])
def test_int8_walk_keys_follow_every_insert_and_refinement(pages):
    """The int8 copy is made again for each page an insert (a bulk build, point-by-point inserts
    that split pages and grow the page arrays) or a refinement changes: it stays the float keys
    rounded, page for page."""
    rng = np.random.default_rng(3)
    t = DCITree(8, IndexConfig(page_size=4, ratio_bottom=0.1, ratio_upper=0.3, pages=pages, refine=2,
                               refine_candidates=4, refine_min=16, walk_keys="int8"), capacity=16)
    t.insert(clustered(300, d=8, seed=1))
    check_int8_copy(t)
    pcap = t.pcap
    for b in (1, 3, 17, 1, 60, 2, 200):
        t.insert((clustered(b, d=8, seed=int(rng.integers(1 << 30))) * rng.uniform(0.5, 3)).astype(np.float32))
        check_int8_copy(t)
    assert t.pcap > pcap  # the page arrays grew, the copy with them
    t.refine(None, 2)
    check_int8_copy(t)
    # a float-keys tree keeps no copy
    f = DCITree(8, IndexConfig(page_size=4, ratio_bottom=0.1))
    f.insert(clustered(300, d=8, seed=1))
    assert f.K8.shape[0] == 0 and f.walk_keys()[0] is f.PX


def rounded_query(q: np.ndarray) -> np.ndarray:
    """A query as the int8 walk scores it: its unit vector rounded to int16 with a step of
    max|v| / 32767 (the step times the int16 values), times its norm: float64."""
    v = q.astype(np.float32) / np.float32(max(np.sqrt(np.sum(q.astype(np.float32) ** 2)), 1e-12))
    top = np.float32(np.abs(v).max())
    step = np.float32(top / np.float32(32767))
    ints = np.clip(np.round(v * (np.float32(32767) / top)), -32767, 32767)
    return ints.astype(np.float64) * float(step) * float(np.linalg.norm(q.astype(np.float64)))


@pytest.mark.parametrize("group", [1, 3, 4, 5, 6, 7, 9])
@pytest.mark.parametrize("d", [16, 7])
def test_int8_walk_with_full_beam_is_exact_on_the_rounded_keys(group, d):
    """A full-beam walk over the int8 copy ranks points and pages exactly as exact search over the
    rounded keys (step x int8 row) against the rounded query (its unit vector in int16) does;
    its scores are within the rounding's bound of the float ones, and differ from them (so the
    walk did read the copy). Groups of queries that the integer sums take four at a time with
    one, two or three left over, and an odd head_dim (the last pair of coordinates half empty)."""
    keys = clustered(2000, d=d, seed=5)
    t = DCITree(d, IndexConfig(page_size=8, beam=10_000, ratio_bottom=0.05, walk_keys="int8"))
    t.insert(keys)
    rounded = t.walk_rows(np.arange(t.n))
    queries = clustered(group, d=d, seed=9)
    ids, scores = t.search_group(queries, 32)
    differ = False
    for r, q in enumerate(queries):
        qr = rounded_query(q)
        assert set(ids[r].tolist()) == set(exact_topk(rounded, qr, 32).tolist())
        np.testing.assert_allclose(scores[r], rounded[ids[r]] @ qr, rtol=1e-5, atol=1e-4)
        bound = t.K8_steps[t.tok_page[ids[r]], t.tok_slot[ids[r]]] / 2 * np.abs(q).sum() + 1e-3
        assert (np.abs(scores[r] - keys[ids[r]] @ q) <= bound).all()
        differ |= not np.allclose(scores[r], keys[ids[r]] @ q, rtol=1e-6, atol=0)
    assert differ
    got = t.select_group(queries, 64, 6)
    ref = merge_group_pages(
        [ranked_pages(exact_topk(rounded, rounded_query(q), 64).astype(np.int32), t.tok_page, 6) for q in queries], 6)
    assert got.tolist() == ref.tolist()


def test_keys_too_wide_for_the_integer_sums_walk_their_float_keys():
    """Past 512 coordinates an int8 key times an int16 query could overflow its int32 sum: such a
    tree keeps no int8 copy and its walks read the float keys, with the float walk's choice."""
    import dataclasses

    keys = clustered(600, d=520, seed=2)
    queries = clustered(3, d=520, seed=3)
    cfg = IndexConfig(page_size=8, beam=6, walk_keys="int8")
    wide = DCITree(520, cfg)
    wide.insert(keys)
    assert wide.K8.shape[0] == 0 and wide.walk_keys()[0] is wide.PX
    plain = DCITree(520, dataclasses.replace(cfg, walk_keys="float32"))
    plain.insert(keys)
    assert wide.select_group(queries, 64, 6).tolist() == plain.select_group(queries, 64, 6).tolist()


def test_the_integer_block_sums_are_the_int64_dot_products():
    """The walk's integer sums (vpmaddwd on AVX2, plain vector arithmetic elsewhere) against
    NumPy's int64 products of the pair copy and the int16 queries, every group size a call
    takes, extreme values included (127 x 32767 over 256 coordinates stays exact in int32), an
    odd number of pairs too (the last pair outside the two accumulators' loop)."""
    from numba import njit

    from icecache.index.kernels.pairs import BLOCK, MAX_GROUP, block_sums, reference_sums

    @njit(cache=False)
    def all_sums(keys, q, out):
        acc = np.empty((MAX_GROUP, BLOCK), np.int32)
        for pg in range(keys.shape[0]):
            for b in range(keys.shape[2] // BLOCK):
                g0 = 0
                while g0 < q.shape[0]:
                    nq = min(MAX_GROUP, q.shape[0] - g0)
                    block_sums(keys, pg, b, q, g0, nq, acc)
                    for r in range(nq):
                        for i in range(BLOCK):
                            out[pg, b * BLOCK + i, g0 + r] = acc[r, i]
                    g0 += nq

    rng = np.random.default_rng(4)
    for pairs, rows, g in ((32, 16, 3), (4, 8, 7), (128, 24, 5), (1, 8, 1), (33, 16, 2)):
        keys = rng.integers(-127, 128, (5, pairs, rows, 2)).astype(np.int8)
        q = rng.integers(-32767, 32768, (g, pairs, 2)).astype(np.int16)
        keys[0] = 127
        q[0] = 32767
        keys[1] = -127
        out = np.zeros((5, rows, g), np.int32)
        all_sums(keys, q, out)
        assert np.array_equal(out.astype(np.int64), reference_sums(keys, q))


@pytest.mark.parametrize("walk_keys", ["float32", "int8"])
def test_layer_walk_split_into_scan_tasks_equals_the_tree_walk(walk_keys, monkeypatch):
    """Fewer KV heads than threads (Gemma 3's one head): the layer's call cuts the bottom scans
    into tasks for every thread; a wide beam lists thousands of bottom rows, several tasks a
    head. Pages, carried pages and token picks as the tree's own one-thread walk has them, for
    one head and for two (made to split by a larger thread count)."""
    from icecache.index import walk as walk_mod
    from icecache.index.kernels import shared
    from icecache.index.kernels.shared import SCAN_ROWS

    trees = []
    for h, n in enumerate((6000, 3000)):
        t = DCITree(16, IndexConfig(page_size=8, beam=5, beam_frac=0.0, walk_keys=walk_keys))
        t.insert(clustered(n, seed=40 + h))
        trees.append(t)
    queries = np.stack([clustered(4, seed=50 + h) for h in range(2)])
    wide = 0.2
    assert len(trees[0].scanned(queries[0], wide)) > 4 * SCAN_ROWS  # several tasks for the one head
    extra = [t.live_pages()[::7][:12] for t in trees]
    monkeypatch.setattr(shared, "get_num_threads", lambda: 4)
    for heads in (1, 2):
        for ex in (None, extra):
            e = [None] * heads if ex is None else ex[:heads]
            want = [t.select_group(queries[h], 64, 8, wide, e[h]) for h, t in enumerate(trees[:heads])]
            got = walk_mod.select_layer(trees[:heads], queries[:heads], 64, 8, wide, ex and ex[:heads])
            assert [g.tolist() for g in got] == [w.tolist() for w in want]
            picked = [t.pick_group(queries[h], 50, 8, wide, e[h]) for h, t in enumerate(trees[:heads])]
            pages, tokens = walk_mod.pick_layer(trees[:heads], queries[:heads], 50, 8, wide, ex and ex[:heads])
            assert [(p.tolist(), k.tolist()) for p, k in zip(pages, tokens, strict=True)] == [
                (p.tolist(), k.tolist()) for p, k in picked]


@pytest.mark.parametrize("walk_keys", ["float32", "int8"])
def test_select_layer_with_either_walk_keys_equals_per_tree_selection(walk_keys):
    """The layer's parallel walk reads the same keys as each tree's own walk (and the carried
    pages' path too): the same pages, head by head."""
    from icecache.index.walk import select_layer

    trees = []
    for h, n in enumerate((4000, 2500, 6000)):
        t = DCITree(16, IndexConfig(page_size=8, beam=5, beam_frac=0.0, walk_keys=walk_keys))
        t.insert(clustered(n, seed=20 + h))
        trees.append(t)
    queries = np.stack([clustered(3, seed=30 + h) for h in range(3)])
    extra = [t.live_pages()[:5] for t in trees]
    for ex in (None, extra):
        want = [t.select_group(queries[h], 48, 6, extra=None if ex is None else ex[h]) for h, t in enumerate(trees)]
        got = select_layer(trees, queries, 48, 6, extra=ex)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_a_layer_walk_keeps_its_arguments_only_while_its_trees_stay_the_same():
    """The layer's walk keeps the numba call's arguments between steps (:class:`walk._Walk`):
    taken again when a tree changes (an insert that grows its arrays, a refinement), when a
    tree of the layer is another object (a forked copy's, a new one), or when a call carries
    more pages than it has room for; each time the pages are each tree's own selection."""
    import copy

    from icecache.index import walk

    def trees_of(seed):
        out = []
        for h, n in enumerate((3000, 2000, 4000)):
            t = DCITree(16, IndexConfig(page_size=8, beam=5, walk_keys="int8", refine=1, refine_min=64))
            t.insert(clustered(n, seed=seed + h))
            out.append(t)
        return out

    trees = trees_of(40)
    queries = np.stack([clustered(3, seed=50 + h) for h in range(3)])

    def check(ts, extra=None):
        want = [t.select_group(queries[h], 48, 6, extra=None if extra is None else extra[h]) for h, t in enumerate(ts)]
        got = walk.select_layer(ts, queries, 48, 6, extra=extra)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        return walk._walks[ts[0]]

    kept = check(trees)
    assert check(trees) is kept  # nothing changed: the same arguments
    pcap = trees[1].pcap
    trees[1].insert(clustered(2500, seed=60))
    assert trees[1].pcap > pcap  # its arrays grew
    kept, before = check(trees), kept
    assert kept is not before
    trees[2].refine(None, 1)
    kept, before = check(trees), kept
    assert kept is not before
    forked = copy.deepcopy(trees)
    forked[0].insert(clustered(40, seed=61))
    check(forked)
    assert check(trees) is kept  # the originals' own arguments still
    other = trees[:2] + trees_of(70)[2:]
    assert check(other) is not kept
    extra = [t.live_pages()[: 3 + 4 * h] for h, t in enumerate(trees)]
    check(trees, extra)
    assert walk._walks[trees[0]].extras.shape[1] >= 11


def test_a_tree_without_an_int8_copy_makes_it_at_its_first_walk():
    """A tree saved by a run that kept no int8 copy (float walk keys, or before the copy
    existed), read by a run that walks int8 keys: the copy is made whole at the first walk and
    the selection is a fresh int8 tree's."""
    import dataclasses

    keys = clustered(3000, seed=6)
    queries = clustered(3, seed=10)
    cfg = IndexConfig(page_size=8, beam=6, walk_keys="int8")
    fresh = DCITree(16, cfg)
    fresh.insert(keys)
    old = DCITree(16, dataclasses.replace(cfg, walk_keys="float32"))
    old.insert(keys)
    del old.K8, old.K8_steps  # as a tree saved before the copy existed: the class's empty ones
    assert old.K8.shape[0] == 0
    old.cfg = cfg
    assert old.select_group(queries, 64, 6).tolist() == fresh.select_group(queries, 64, 6).tolist()
    check_int8_copy(old)
    old.insert(clustered(50, seed=11))  # and it is kept from then on
    check_int8_copy(old)


def check_top_copy(t: DCITree) -> None:
    """The walks' kept copy of the top levels (:func:`~icecache.index.kernels.shared.top_copy`)
    against the tree itself: it holds every point from the top level down to the lowest level
    above the bottom at which they number at most ``top_rows``, the levels above that one first,
    a tree page's rows together, each row the key the walks read at that point's place."""
    keys, steps, (held, first, tk, ts, tm, tc, tp) = t.walk_keys()
    level = t.level[: t.n].astype(int)
    counts = [int((level == lvl).sum()) for lvl in range(t.top_level + 1)]
    want = 0
    for lvl in range(t.top_level, 0, -1):
        if sum(counts[lvl:]) > t.cfg.top_rows:
            break
        want = lvl
    assert held == want
    if want == 0:
        assert len(tp) == 0
        return
    rows = np.concatenate([tm[x, : tc[x]] for x in range(len(tc))])
    assert sorted(rows.tolist()) == np.flatnonzero(level >= want).tolist()
    assert first == int((level > want).sum())
    assert (level[rows[:first]] > want).all() and (level[rows[first:]] == want).all()
    assert (tp == t.tok_page[rows]).all()
    starts = np.flatnonzero(np.r_[True, tp[1:] != tp[:-1]])
    assert len(starts) == len(set(tp.tolist()))  # a page's rows together
    page, slot = t.tok_page[rows], t.tok_slot[rows]
    S = t.cfg.page_size
    at = np.arange(len(rows))
    if keys.ndim == 4:  # the int8 pairs: (pages, pairs, rows, 2)
        assert (tk[at // S, :, at % S] == keys[page, :, slot]).all()
        assert (ts[at // S, at % S] == steps[page, slot]).all()
    else:
        assert (tk[at // S, at % S, : t.d] == keys[page, slot, : t.d]).all()


@pytest.mark.parametrize("walk_keys", ["int8", "float32"])
@pytest.mark.parametrize("top_rows", [0, 40, 2048])
def test_the_top_copy_follows_every_insert_and_refinement(walk_keys, top_rows):
    """The copy of the levels a walk scans whole is the tree's, after a build, after inserts
    that add only bottom points (kept: they touch bottom pages only) or points above the bottom
    (made again), after a refinement; ``top_rows`` picks how many levels it holds."""
    rng = np.random.default_rng(5)
    t = DCITree(8, IndexConfig(page_size=4, ratio_bottom=0.1, ratio_upper=0.3, refine=1, refine_min=16,
                               walk_keys=walk_keys, top_rows=top_rows), capacity=16)
    t.insert(clustered(400, d=8, seed=2))
    check_top_copy(t)
    kept = 0
    for b in (1, 2, 1, 3, 17, 1, 60, 2, 200, 1):
        made = t._top
        t.insert((clustered(b, d=8, seed=int(rng.integers(1 << 30))) * rng.uniform(0.5, 3)).astype(np.float32))
        check_top_copy(t)
        kept += t._top is made
    assert kept  # some inserts added bottom points only and the copy was kept
    t.refine(None, 1)
    check_top_copy(t)


def test_a_walk_from_the_top_copy_chooses_what_the_level_by_level_walk_does_when_its_beam_covers_them():
    """Where the beam covers every node above level 1, the level-by-level walk scans all of
    level 1 too and expands each query's beam best of it: the walk from the copy (levels 1 and
    up scanned whole) chooses the same pages and scans the same points."""
    import dataclasses

    keys = clustered(4000, seed=12)
    cfg = IndexConfig(page_size=8, ratio_bottom=1 / 16, walk_keys="int8")
    t = DCITree(16, cfg)
    t.insert(keys)
    level = t.level[: t.n]
    beam = int((level >= 2).sum())
    assert beam < (level == 1).sum() <= cfg.top_rows
    walked = DCITree(16, dataclasses.replace(cfg, beam=beam, top_rows=0))
    walked.insert(keys)
    t.cfg = dataclasses.replace(cfg, beam=beam)
    assert t.walk_keys()[2][0] == 1
    for seed in range(6):
        q = clustered(3, seed=100 + seed)
        assert t.select_group(q, 256, 16).tolist() == walked.select_group(q, 256, 16).tolist()
        assert sorted(t.scanned(q).tolist()) == sorted(walked.scanned(q).tolist())


def test_a_walk_from_the_top_copy_expands_each_querys_exact_best_level_1_nodes():
    """With level 1 in the copy, the bottom points a walk scans are the children of the union
    of each query's ``beam`` best level-1 points by inner product (float walk keys: the scores
    are the transformed keys' own), the exact frontier a narrower level-by-level walk
    approximates."""
    keys = clustered(6000, seed=13)
    t = DCITree(16, IndexConfig(page_size=8, ratio_bottom=1 / 16, beam=12, walk_keys="float32"))
    t.insert(keys)
    level = t.level[: t.n]
    ones = np.flatnonzero(level == 1)
    assert t.walk_keys()[2][0] == 1 and len(ones) > 12
    for seed in range(4):
        q = clustered(3, seed=200 + seed)
        best = set()
        for r in range(3):
            scores = keys[ones].astype(np.float64) @ q[r].astype(np.float64)
            best |= set(ones[np.argsort(-scores, kind="stable")[:12]].tolist())
        scanned = t.scanned(q)
        bottom = scanned[level[scanned] == 0]
        want = np.flatnonzero((level == 0) & np.isin(t.parent[: t.n] - 1, list(best)))
        assert sorted(bottom.tolist()) == want.tolist()
