"""The paper's other baselines as selectors (h2o, arkvale, omnikv, pqcache, magicpig): each
against full attention with a budget that covers everything, each against a NumPy reference of
what it computes, and the shared token packing's invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.cache.paged import paged_decode_sdpa, paged_decode_weighted, paged_decode_weighted_reference
from icecache.cache.selectors.snapkv import ObservationSettings
from icecache.cache.selectors.tokens import QueryGrid, TokenPages, group_weights, top_tokens

from .test_ice_cache import full_cache, ice_cache, run_steps, spec, tiny_model
from .test_pinned import SETTINGS, run_adopted, run_case
from .test_pinned import tiny_model as pinned_model

NEW = ("h2o", "arkvale", "omnikv", "pqcache", "magicpig")
REUSE = {"omnikv": 2}  # the tiny model's 3 sparse layers: a filter layer and its follower


# -- every method through the cache ------------------------------------------------------------
@pytest.mark.parametrize("selector", NEW)
def test_budget_covering_everything_equals_full(selector):
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(1)
    prompt_ids = rng.integers(0, 97, 150).tolist()
    forced = rng.integers(0, 97, 40).tolist()  # the window evicts pages into the selector
    ref = run_steps(model, full_cache(model), prompt_ids, forced)
    cache = ice_cache(model, spec(budget_pages=256, selector=selector), reuse=REUSE.get(selector, 1))
    got = run_steps(model, cache, prompt_ids, forced)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    assert cache.stats.pages_loaded > 0


@pytest.mark.parametrize("selector", NEW)
def test_a_small_budget_selects_within_it_and_differs_from_full(selector):
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(2)
    prompt_ids = rng.integers(0, 97, 150).tolist()
    forced = rng.integers(0, 97, 24).tolist()
    ref = run_steps(model, full_cache(model), prompt_ids, forced)
    cache = ice_cache(model, spec(budget_pages=3, selector=selector), reuse=REUSE.get(selector, 1))
    got = run_steps(model, cache, prompt_ids, forced)
    assert max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True)) > 1e-3
    for layer in cache.ice_layers():
        assert all(len(pages) <= 3 for pages in layer.selected)
        assert int(layer.resident.valid[:, layer.resident.pool_at : layer.resident.window_at].sum(1).max()) <= 12


@pytest.mark.parametrize("method", NEW)
def test_the_shared_prefill_gives_what_the_methods_own_prefill_gives(method):
    """The eval's path (one recorded dense prefill adopted by each method) decodes exactly as the
    method's own chunked prefill does: H2O's prompt queries arrive either way."""
    model = pinned_model()
    own = run_case(model, method, SETTINGS)["tokens"]
    adopted = run_adopted(model, [method])[method]
    assert len(adopted) >= 8 and adopted == own[: len(adopted)]
    if len(adopted) < len(own):  # a session stops at the end-of-text token; run_case does not
        assert own[len(adopted)] == model.generation_config.eos_token_id


def test_methods_are_registered_with_their_properties(cpu_settings):
    from icecache import methods

    for name in NEW:
        m = methods.get(name)
        assert m.cache is methods.PAGED and m.selector == name and m.budgeted
    assert methods.reads_prompt_queries(methods.get("h2o"))
    assert methods.reads_prompt_queries(methods.get("snapkv"))
    assert not methods.reads_prompt_queries(methods.get("pqcache"))
    from icecache.cache import IceCache

    omni = methods.get("omnikv")
    cache = IceCache(30, methods.ice_spec(cpu_settings, omni), dense_layers=2,
                     anchors=methods.anchor_layers(omni, 30, 2))
    anchors = [layer.layer_idx for layer in cache.ice_layers() if layer.anchor is None]
    assert anchors == [2, 8, 17]  # the embedded model's shape: OmniKV's 2, 8, 18 of 32 scaled to 30
    followers = {layer.layer_idx: layer.anchor.layer_idx for layer in cache.ice_layers() if layer.anchor}
    assert followers[7] == 2 and followers[16] == 8 and followers[29] == 17
    assert methods.anchor_layers(omni, 32, 2) == {2, 8, 18}  # the authors' own model
    assert methods.anchor_layers(omni, 4, 2) == {2}  # a tiny model: the first sparse layer
    assert methods.anchor_layers(methods.get("ice-reuse"), 30, 2) is None  # reuse_every decides


# -- token packing -------------------------------------------------------------------------------
def test_token_pages_keep_every_chosen_token_once_and_bump_only_changed_pages():
    rng = np.random.default_rng(0)
    pages = TokenPages(page_size=4, pages=6)
    prev_members = pages.members.copy()
    prev_version = pages.version.copy()
    for _ in range(300):
        n = int(rng.integers(0, 25))
        tokens = rng.choice(60, n, replace=False)
        ids = pages.choose(tokens)
        held = pages.members[ids]
        assert sorted(held[held >= 0].tolist()) == sorted(tokens.tolist())
        for p in range(6):  # packed at the front, count right
            c = pages.count[p]
            assert (pages.members[p, :c] >= 0).all() and (pages.members[p, c:] == -1).all()
        same = (pages.members == prev_members).all(1)
        assert (pages.version[same] == prev_version[same]).all()
        assert (pages.version[~same] > prev_version[~same]).all()
        prev_members, prev_version = pages.members.copy(), pages.version.copy()
    with pytest.raises(ValueError):
        pages.choose(np.arange(25))


def test_a_token_that_stays_chosen_stays_in_its_page():
    pages = TokenPages(page_size=4, pages=4)
    pages.choose(np.arange(16))
    where = {int(t): p for p in range(4) for t in pages.members[p, : pages.count[p]]}
    pages.choose(np.array([*range(1, 16), 40]))  # token 0 leaves, 40 arrives
    for p in range(4):
        for t in pages.members[p, : pages.count[p]]:
            if int(t) != 40:
                assert where[int(t)] == p
    assert pages.version.tolist() == [2, 1, 1, 1]


def test_group_weights_and_top_tokens_match_plain_numpy():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((3, 8)), rng.standard_normal((50, 8))
    ref = np.zeros(50)
    for row in q:
        s = k @ row * 0.5
        ref += np.exp(s) / np.exp(s).sum()
    np.testing.assert_allclose(group_weights(q, k, 0.5), ref, rtol=1e-10)
    score = rng.standard_normal(50)
    assert set(top_tokens(score, 7).tolist()) == set(np.argsort(-score)[:7].tolist())
    assert top_tokens(score, 80).tolist() == list(range(50))


def test_query_grid_keeps_a_uniform_grid_and_the_tail():
    grid = QueryGrid(limit=16, tail=4)
    for lo in range(0, 200, 50):
        grid.add(torch.randn(2, 50, 3), np.arange(lo, lo + 50))
    q, pos, w = grid.arrays(200)
    assert len(pos) <= 20 and pos[-4:].tolist() == [196, 197, 198, 199]
    grid_part = pos[:-4]
    assert len(set(np.diff(grid_part).tolist())) == 1  # one step
    assert w.sum() == 200 and q.shape == (2, len(pos), 3)
    small = QueryGrid(limit=1024, tail=4)
    small.add(torch.randn(2, 30, 3))
    assert small.arrays(30)[1].tolist() == list(range(30))


def test_query_grid_adds_a_chunk_as_its_definition_says():
    """``add`` picks a chunk's kept positions at once. After any sequence of chunks, the grid
    holds exactly the positions its definition keeps: every ``stride``-th and the last ``tail``,
    with ``stride`` the smallest power of two that keeps at most ``limit + tail``. Each entry is
    its query in float16, in its own small storage."""
    torch.manual_seed(3)
    chunks = [torch.randn(3, n, 4) for n in (70, 1, 33, 128, 5, 64)]
    every = torch.cat(chunks, dim=1)
    grid = QueryGrid(limit=12, tail=5)
    for i, c in enumerate(chunks):
        grid.add(c)
        last = sum(x.shape[1] for x in chunks[: i + 1]) - 1

        def kept(stride, last=last):
            return [p for p in range(last + 1) if (p + 1) % stride == 0 or p > last - 5]

        stride = 1
        while len(kept(stride)) > 12 + 5:
            stride *= 2
        assert grid.stride == stride and sorted(grid.queries) == kept(stride)
        for p, q in grid.queries.items():
            assert torch.equal(q, every[:, p].to(torch.float16))
            assert q.untyped_storage().nbytes() == 3 * 4 * 2  # not a view of the chunk's copy
    assert grid.stride > 1


# -- H2O -----------------------------------------------------------------------------------------
def test_h2o_prompt_scores_match_a_dense_recomputation():
    from icecache.cache.selectors.h2o import prompt_scores

    rng = np.random.default_rng(4)
    G, T, d = 3, 40, 8
    keys = rng.standard_normal((T, d)).astype(np.float32)
    pos = np.array([3, 10, 11, 25, 39])
    q = rng.standard_normal((G, len(pos), d)).astype(np.float32)
    w = np.array([4.0, 7, 1, 14, 14])
    ref = np.zeros(T)
    for g in range(G):
        for j, p in enumerate(pos):
            s = keys[: p + 1] @ q[g, j] * 0.3
            e = np.exp(s - s.max())
            ref[: p + 1] += w[j] * e / e.sum()
    np.testing.assert_allclose(prompt_scores(q, pos, w, keys, 0, T, 0.3), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(prompt_scores(q, pos, w, keys, 5, 30, 0.3), ref[5:30], rtol=1e-5, atol=1e-7)


def test_h2o_keeps_the_heaviest_prompt_tokens_and_evicts_for_good():
    from icecache.cache.selectors.h2o import H2OSelector
    from icecache.cache.spec import IceSpec

    rng = np.random.default_rng(5)
    H, G, T, d, S = 2, 2, 64, 8, 4
    s = IceSpec(page_size=S, budget_pages=2, sink_tokens=4, window_tokens=4, selector="h2o",
                tuning=ObservationSettings(observation=4))
    sel = H2OSelector(s)
    keys = torch.from_numpy(rng.standard_normal((H, T, d)).astype(np.float32))
    queries = torch.from_numpy(rng.standard_normal((H * G, T, d)).astype(np.float32))
    sel.observe(queries, np.arange(T))
    sel.build(keys, 4, T - 4, 100)
    for h in range(H):  # the dense accumulated attention of every prompt query
        acc = np.zeros(T)
        for g in range(G):
            for p in range(T):
                sc = keys[h, : p + 1].numpy() @ queries[h * G + g, p].numpy() * d ** -0.5
                e = np.exp(sc - sc.max())
                acc[: p + 1] += e / e.sum()
        mid = acc[4 : T - 4]
        np.testing.assert_allclose(sel.acc[h][: T - 8], mid, rtol=2e-3)  # float16 queries
        assert set(sel.kept[h].tolist()) == set(np.argsort(-mid)[:8].tolist())
    q = rng.standard_normal((H, G, d)).astype(np.float32)
    before = [k.copy() for k in sel.kept]
    sel.select(q, 2)
    for h in range(H):
        assert set(sel.kept[h].tolist()) == set(before[h].tolist())  # nothing new: the same set
        dead = np.setdiff1d(np.arange(T - 8), sel.kept[h])
        assert not sel.alive[h][dead].any()  # evicted at the prompt: gone
    sel.insert(torch.from_numpy(rng.standard_normal((H, 4, d)).astype(np.float32) * 3))
    sel.select(q, 2)
    for h in range(H):
        assert len(sel.kept[h]) == 8 and sel.alive[h][: T - 4].sum() == 8


# -- PQCache -------------------------------------------------------------------------------------
def test_pq_codes_are_the_nearest_centroids_and_scores_use_them():
    from icecache.cache.selectors.pqcache import PQCodes

    rng = np.random.default_rng(6)
    keys = rng.standard_normal((300, 16)).astype(np.float32)
    pq = PQCodes(keys, subspaces=4, bits=3)
    more = rng.standard_normal((20, 16)).astype(np.float32)
    pq.add(more)
    allk = np.concatenate([keys, more])
    recon = np.zeros_like(allk)
    for i, row in enumerate(allk):
        for s, book in enumerate(pq.books):
            sub = row[s * 4 : (s + 1) * 4]
            best = int(np.argmin(((book - sub) ** 2).sum(1)))
            assert pq.codes[i, s] == best
            recon[i, s * 4 : (s + 1) * 4] = book[best]
    q = rng.standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(pq.scores(q), q @ recon.T, rtol=1e-4, atol=1e-4)
    # k-means lowered the quantization error below the random start's
    err = ((allk - recon) ** 2).sum()
    assert err < 0.9 * ((allk - allk[rng.choice(len(allk), len(allk))]) ** 2).sum()


# -- MagicPIG ------------------------------------------------------------------------------------
def test_simhash_buckets_and_hits_match_a_plain_count():
    from icecache.cache.selectors import magicpig

    rng = np.random.default_rng(7)
    planes = rng.standard_normal((6, 3, 8)).astype(np.float32)
    x = rng.standard_normal((40, 8)).astype(np.float32)
    codes = magicpig.simhash(x, planes)
    for i in range(40):
        for t in range(6):
            want = sum(1 << j for j in range(3) if x[i] @ planes[t, j] > 0)
            assert codes[i, t] == want
    tables = magicpig.LSHTables(planes, np.zeros(8, np.float32))
    tables.add(x[:30])
    tables.add(x[30:])  # since the build: scanned
    q = rng.standard_normal(8).astype(np.float32)
    qc = magicpig.simhash(q[None], planes)[0]
    np.testing.assert_array_equal(tables.hits(q), (codes == qc[None]).sum(1))


def test_sampling_probability_is_the_binomial_tail():
    from math import comb

    from icecache.cache.selectors.magicpig import sample_probability

    cos = np.array([-0.5, 0.0, 0.3, 0.9])
    got = sample_probability(cos, bits=4, tables=10, hits=2)
    for c, g in zip(cos, got, strict=True):
        p = (1 - np.arccos(c) / np.pi) ** 4
        want = sum(comb(10, j) * p ** j * (1 - p) ** (10 - j) for j in range(2, 11))
        assert abs(g - want) < 1e-9
    assert (np.diff(got) > 0).all()


def test_weighted_attention_matches_its_reference_and_plain_attention_without_weights():
    rng = np.random.default_rng(8)
    H, G, L, d = 2, 3, 20, 8
    q = torch.from_numpy(rng.standard_normal((H, G, d)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((H, L, d)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((H, L, d)).astype(np.float32))
    valid = torch.from_numpy(rng.random((H, L)) < 0.8)
    valid[:, 0] = True
    bias = torch.from_numpy(rng.standard_normal((H, G, 8)).astype(np.float32))
    bias[0, 1, 2] = float("-inf")
    got = paged_decode_weighted(q, k, v, valid, bias, 4, 0.5)
    torch.testing.assert_close(got, paged_decode_weighted_reference(q, k, v, valid, bias, 4, 0.5),
                               atol=1e-5, rtol=1e-5)
    zero = torch.zeros(H, G, 8)
    torch.testing.assert_close(paged_decode_weighted(q, k, v, valid, zero, 4, 0.5),
                               paged_decode_sdpa(q, k, v, valid, 0.5), atol=1e-5, rtol=1e-5)
    # the estimator itself: a sampled row of chance p counts exp(score) / p
    scores = (q[0, 1] @ k[0].T) * 0.5 + torch.where(valid[0], 0.0, float("-inf"))
    scores[4:12] += bias[0, 1]
    ref = torch.softmax(scores, 0) @ v[0]
    torch.testing.assert_close(got[0, 1], ref, atol=1e-5, rtol=1e-5)


def test_magicpig_row_bias_follows_the_pool_rows():
    from icecache.cache.selectors.magicpig import MagicPIGSelector

    sel = MagicPIGSelector.__new__(MagicPIGSelector)
    sel.sampled = [(np.array([3, 7, 9]), np.array([[0.5, -np.inf, 1.0], [0.1, 0.2, 0.3]], np.float32)),
                   (np.array([2]), np.array([[0.7], [-np.inf]], np.float32))]
    rows = np.array([[9, 3, -1, 7], [2, -1, 5, 2]])
    out = sel.row_bias(rows)
    np.testing.assert_array_equal(out[0, 0], [1.0, 0.5, -np.inf, -np.inf])
    np.testing.assert_allclose(out[0, 1], [0.3, 0.1, -np.inf, 0.2])
    np.testing.assert_allclose(out[1, 0], [0.7, -np.inf, -np.inf, 0.7])
    assert np.isneginf(out[1, 1]).all()


def test_magicpig_samples_what_collides_and_weighs_by_the_chance():
    from icecache.cache.selectors import magicpig
    from icecache.cache.spec import IceSpec

    rng = np.random.default_rng(9)
    H, G, n, d = 1, 2, 3000, 16
    keys = rng.standard_normal((H, n, d)).astype(np.float32)
    sel = magicpig.MagicPIGSelector(IceSpec(page_size=16, budget_pages=64, selector="magicpig"))
    sel.build(torch.from_numpy(keys), 0, n, n)
    q = rng.standard_normal((H, G, d)).astype(np.float32)
    q[0, 0] = keys[0, 17] * 3  # one query points at a key: that key must be sampled
    pages = sel.select(q, 64)[0]
    rows, bias = sel.sampled[0]
    assert 17 in rows.tolist() and len(rows) <= 64 * 16
    assert set(sel.pages[0].members[pages][sel.pages[0].members[pages] >= 0].tolist()) == set(rows.tolist())
    t = sel.tables[0]
    counts = np.stack([t.hits(x) for x in q[0]])
    for g in range(G):
        hit = counts[g, rows] >= magicpig.MIN_HITS
        assert np.isfinite(bias[g, hit]).all() and np.isneginf(bias[g, ~hit]).all()
        c = keys[0, rows[hit]] - t.centre
        cos = c @ q[0, g] / (np.linalg.norm(c, axis=1) * np.linalg.norm(q[0, g]))
        np.testing.assert_allclose(bias[g, hit], -np.log(magicpig.sample_probability(cos)), rtol=1e-4)


# -- ArkVale -------------------------------------------------------------------------------------
def test_arkvale_digests_scores_and_resident_set():
    from icecache.cache.selectors.arkvale import ArkValeSelector
    from icecache.cache.spec import IceSpec

    rng = np.random.default_rng(10)
    H, n, d, S = 2, 70, 8, 8
    keys = rng.standard_normal((H, n, d)).astype(np.float32)
    sel = ArkValeSelector(IceSpec(page_size=S, budget_pages=4, selector="arkvale"))
    sel.build(torch.from_numpy(keys), 0, n, n)
    assert sel.npages == 9 and sel.count[8] == 6
    for h in range(H):
        for p in range(9):
            part = keys[h, p * S : (p + 1) * S]
            centre = (part.max(0) + part.min(0)) / 2
            dev = np.abs(part - centre).mean(0)
            np.testing.assert_allclose(sel.lo[h, p], centre - dev, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(sel.hi[h, p], centre + dev, rtol=1e-6, atol=1e-6)
    q = rng.standard_normal((H, 3, d)).astype(np.float32)
    ref = np.zeros(9)
    for h in range(H):
        for p in range(9):
            for x in q[h]:
                ref[p] += sum(max(x[i] * sel.lo[h, p, i], x[i] * sel.hi[h, p, i]) for i in range(d))
    np.testing.assert_allclose(sel.page_scores(q), ref, rtol=1e-5)
    first = sel.select(q, 4)
    assert all((f == first[0]).all() for f in first)  # one page set for every KV head
    assert set(first[0].tolist()) == set(np.argsort(-ref)[:4].tolist())
    q2 = rng.standard_normal((H, 3, d)).astype(np.float32)
    s2 = sel.page_scores(q2)
    second = sel.select(q2, 4)[0]
    top2 = np.argsort(-s2)[:2]
    assert set(top2.tolist()) <= set(second.tolist())  # the best half is always recalled
    rest = [p for p in second.tolist() if p not in top2.tolist()]
    assert set(rest) <= set(first[0].tolist())  # the other half: kept from the resident set
    sel.insert(torch.from_numpy(rng.standard_normal((H, 10, d)).astype(np.float32)))
    assert sel.npages == 10 and sel.count[8] == 8 and sel.count[9] == 8
