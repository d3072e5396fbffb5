"""``answer_spans``: the prompt's end votes over the offloaded tokens, and the voted passages stay
resident, in token order, for the generated tokens after that."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.cache import IceSpec, spans
from icecache.cache.placement import placing_order
from icecache.cache.spans import SpanVotes, head_weights, pinned_rows
from icecache.config import ProfileError, resolve_settings
from tests.test_ice_cache import full_cache, ice_cache, run_steps, spec, tiny_model


def test_passages_follow_the_votes_and_never_overlap():
    votes = np.zeros(100)
    votes[[50, 52, 10, 98, 70]] = [5.0, 4.0, 3.0, 2.0, 1.0]
    # 52 lies in 50's reach: the next anchors are 10 and 98 (clipped at the end)
    rows = pinned_rows(votes, 3, before=2, after=4)
    assert rows.tolist() == [8, 9, 10, 11, 12, 13, 48, 49, 50, 51, 52, 53, 96, 97, 98, 99]
    assert pinned_rows(votes, 1, 2, 4).tolist() == [48, 49, 50, 51, 52, 53]
    assert len(pinned_rows(np.zeros(10), 2, 2, 4)) == 0  # nothing voted: nothing pinned
    assert len(pinned_rows(votes, 0, 2, 4)) == 0


def test_merged_passages_join_a_well_voted_row_next_to_one():
    """``merge`` (with ``remap_pin_gap``): a row voted second just before the best passage
    becomes an anchor too, and its passage joins the best one; the passage ranks follow the
    best anchor of each joined run."""
    votes = np.zeros(100)
    votes[[50, 45, 51, 80]] = [5.0, 4.0, 3.0, 2.0]
    # without merge 45 is within 50's reach (skipped) and 51 inside its passage: 80 comes next
    assert spans.pinned_anchors(votes, 3, 2, 4) == [50, 80]
    assert spans.pinned_anchors(votes, 3, 2, 4, merge=True) == [50, 45, 80]
    rows = pinned_rows(votes, 3, 2, 4, merge=True)
    assert rows.tolist() == [43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 78, 79, 80, 81, 82, 83]
    v = SpanVotes(3, 2)
    v.before, v.after = 2, 4
    v.add(votes, 10)
    assert v.rows(100, merge=True).tolist() == rows.tolist() and v.best == 50
    # the joined run 43..53 ranks as 50's passage (0), 78..83 as 80's (2); other rows: 3
    assert v.passage_rank(np.array([43, 47, 53, 80, 0, 60])).tolist() == [0, 0, 0, 2, 3, 3]
    # passages that do not merge rank by their own anchors
    w = SpanVotes(3, 2)
    w.before, w.after = 2, 4
    w.add(votes, 10)
    w.rows(100)
    assert w.anchors == [50, 80] and w.passage_rank(np.array([48, 78, 45])).tolist() == [0, 1, 2]


def test_passages_do_not_overlap_on_random_votes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, k = int(rng.integers(1, 400)), int(rng.integers(1, 6))
        votes = rng.random(n)
        rows = pinned_rows(votes, k, 4, 8)
        assert len(rows) == len(np.unique(rows)) <= 12 * k
        assert rows.min() >= 0 and rows.max() < n
        top = int(votes.argmax())  # the best row's passage is there, clipped to the rows there are
        assert set(range(max(0, top - 4), min(n, top + 8))) <= set(rows.tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [20, 2 * spans.VOTE_BLOCK + 5])  # one block; blocks and a partial one
def test_head_weights_are_the_heads_largest_softmax_weights(n, dtype):
    """Over the first n rows of a store's buffer (more rows than that, the rest not voted over),
    whatever the host dtype: 16-bit keys through the numba kernel, float32 through the reference."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 3, 8)).astype(np.float32)
    buf = torch.from_numpy(rng.normal(size=(2, n + 7, 8)).astype(np.float32)).to(dtype)
    k = buf[:, :n].double().numpy()
    s = np.einsum("hgd,hnd->hgn", q.astype(np.float64), k) * 0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)).max((0, 1))
    got = head_weights(torch.from_numpy(q), buf, n, 0.5)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert got.shape == (n,) and 1 / n <= got.max() <= 1.0
    assert head_weights(torch.from_numpy(q), buf, 0, 0.5).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_scores_equal_the_reference_product(dtype):
    """The kernel's conversion of 16-bit rows against torch's: signs, zeros and magnitudes over
    the float16 range's normal values (1e-4 .. 6e4), rows 0 .. n-1 of a longer buffer, several
    parallel blocks and a partial one; a query group of 4 heads."""
    from icecache.cache.score_kernels import HALF_BLOCK, half_scores

    rng = np.random.default_rng(5)
    H, G, d, n = 2, 4, 16, 2 * HALF_BLOCK + 37
    mag = 10.0 ** rng.uniform(-4, 4.7, size=(H, n + 9, d))
    keys = torch.from_numpy(mag * rng.choice([-1.0, 1.0], size=mag.shape)).to(dtype)
    keys[0, 3] = 0.0
    keys[1, 5, :4] = -0.0
    q = torch.from_numpy(rng.normal(size=(H, G, d)).astype(np.float32)) * 1e-3
    out = np.full((H, G, n), np.nan, np.float32)
    half_scores(q.numpy(), keys.view(torch.int16).numpy().view(np.uint16), n, dtype == torch.bfloat16, out)
    want = spans.vote_scores_reference(q, keys[:, :n]).numpy()
    exact = np.einsum("hgd,hnd->hgn", q.double().numpy(), keys[:, :n].double().numpy())
    np.testing.assert_allclose(want, exact, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-3)
    assert np.all(out[0, :, 3] == 0.0)


def test_a_row_keeps_its_best_vote():
    """Many rows a little (a sentence end every head glances at) lose to one row a head looks up."""
    v = SpanVotes(1, page_size=2)
    for _ in range(5):
        v.add(np.array([0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    v.add(np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0]))
    np.testing.assert_allclose(v.votes, [0.3, 0, 0, 0, 0, 0.9, 0, 0])
    assert v.rows(8).tolist() == [3, 4, 5, 6, 7]


def test_votes_stop_once_the_passages_are_chosen():
    v = SpanVotes(1, page_size=2)
    v.add(np.array([0.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    v.add(np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]))  # a longer store: votes grow
    assert v.rows(8).tolist() == [5, 6, 7]
    v.add(np.array([9.0] * 8))  # too late: the choice stands
    assert v.rows(8).tolist() == [5, 6, 7]


def _spans(budget_pages: int, spans: int) -> IceSpec:
    return IceSpec(**{**spec(budget_pages=budget_pages).__dict__, "answer_spans": spans})


def test_spans_with_room_for_everything_equal_full():
    """With every page selected, a pinned row is attended once: the output is full attention."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 97, 150).tolist()
    forced = rng.integers(0, 97, 30).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    cache = ice_cache(model, _spans(256, 2))
    got = run_steps(model, cache, prompt, forced)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    assert all(layer.passages.pinned is not None and len(layer.passages.pinned.tokens()) == 24 for layer in cache.ice_layers())


def test_a_small_budget_keeps_the_voted_passages_resident():
    """Budget 2 pages: from the first generated token on (the prompt came whole: its last
    queries voted) every head of every sparse layer holds the voted passages' rows, each once,
    beside its own selection; the output differs from without."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 97, 200).tolist()
    forced = rng.integers(0, 97, 20).tolist()
    plain = run_steps(model, ice_cache(model, spec(budget_pages=2)), prompt, forced)
    cache = ice_cache(model, _spans(2, 2))
    got = run_steps(model, cache, prompt, forced)
    torch.testing.assert_close(got[0], plain[0])  # the prompt's own logits: no passage yet
    assert float((got[1] - plain[1]).abs().max()) > 1e-4  # the first generated token's step reads them
    votes = cache.ice_layers()[0].passages.votes
    want = pinned_rows(votes.votes[: 200 - 16], 2, 4, 8)  # the host rows at the vote
    assert len(want) == 24
    for layer in cache.ice_layers():
        assert layer.passages.pinned.tokens().tolist() == sorted(want.tolist()) or \
            sorted(layer.passages.pinned.tokens().tolist()) == want.tolist()
        r = layer.resident
        pool = slice(r.pool_at, r.window_at)
        for h in range(layer.heads):
            rows = r.pool_row[h][r.valid[h, pool]]
            assert len(rows) == len(np.unique(rows))  # attended once
            assert set(want.tolist()) <= set(rows.tolist())
            assert len(rows) <= 24 + 2 * 4


def test_answer_spans_setting_is_checked():
    s = resolve_settings("cpu", answer_spans=4)
    assert s.answer_spans == 4
    with pytest.raises(ProfileError, match="answer.spans"):
        resolve_settings("cpu", answer_spans=17)


def test_remapped_passages_sit_nearest_the_window_in_their_own_order():
    """With remapped positions (ordered), a pinned passage's rows come after the selected rows
    (nearest the window), in their own token order; a passage that continues the sink stays in
    token order right after it."""
    from tests.test_positions import remapped_pinned_cache

    _model, cache, logits = remapped_pinned_cache(6, 10, 32)
    assert torch.isfinite(logits).all()
    checked = 0
    for layer in cache.ice_layers():
        r = layer.resident
        valid = r.valid[:, r.pool_at : r.window_at]
        keys = placing_order(r, layer.remap, layer.passages, valid)
        cut = (r.pool_pages - r.pinned_slots) * r.page_size
        rows = np.sort(layer.passages.pinned.tokens())
        lead = int(np.sum(rows == np.arange(len(rows))))
        for h in range(layer.heads):
            main = keys[h, :cut][valid[h, :cut]]
            pin_rows = r.pool_row[h, cut:][valid[h, cut:]]
            pin_keys = keys[h, cut:][valid[h, cut:]]
            assert sorted(pin_rows.tolist()) == rows.tolist()
            moved = pin_rows >= lead
            assert (pin_keys[~moved] == pin_rows[~moved]).all()  # the sink's continuation stays
            if moved.any() and len(main):
                assert pin_keys[moved].min() > main.max()
            order = np.argsort(pin_rows[moved])
            assert (np.diff(pin_keys[moved][order]) > 0).all()  # their own token order
            checked += int(moved.sum())
    assert checked > 0


@pytest.mark.parametrize("tail", [0, 1, 12, 40])
def test_the_prompts_last_stepped_tokens_vote_and_its_last_step_pins(monkeypatch, tail):
    """The votes are each row's largest head weight over the prompt's last steps that run one
    token at a time (at most VOTE_STEPS of them), and the prompt's last step pins them. A prompt
    whose end came in a chunk votes with that chunk's last queries at the first generated
    token's step, which pins; with one stepped token, that step votes and the next pins. Later
    tokens never vote."""
    from icecache.cache.spec import VOTE_STEPS

    calls: list[tuple[int, np.ndarray]] = []
    weights = spans.head_weights

    def recorded(queries, keys, n, scale, softcap=None):
        got = weights(queries, keys, n, scale, softcap)
        calls.append((step[0], got))
        return got

    monkeypatch.setattr(spans, "head_weights", recorded)
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(7)
    prompt, forced = rng.integers(0, 97, 200).tolist(), rng.integers(0, 97, 6).tolist()
    cache = ice_cache(model, _spans(2, 1))
    layers = cache.ice_layers()
    step = [0]  # 1, 2, ...: the stepped prompt tokens, then the generated ones
    pinned_at = {}
    with torch.inference_mode():
        cut = len(prompt) - tail
        cache.begin_prefill(cut, tail=tail)
        for lo in range(0, cut, 64):
            model(input_ids=torch.tensor([prompt[lo : min(cut, lo + 64)]]), past_key_values=cache,
                  use_cache=True)
        cache.end_prefill()
        for i, t in enumerate(prompt[cut:] + forced):
            step[0] = i + 1
            model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            for j, layer in enumerate(layers):
                if layer.passages.pinned is not None:
                    pinned_at.setdefault(j, i + 1)
    voting = sorted({s for s, _ in calls})
    if tail >= 2:  # votes up to the one before the prompt's last, which pins
        want, pin = list(range(max(1, tail - VOTE_STEPS + 1), tail)), tail
    elif tail == 1:  # the one stepped token votes, the next step pins
        want, pin = [1], 2
    else:  # the chunks' last queries vote at the first generated token's step, which pins
        want, pin = [1], 1
    assert voting == want
    assert len(calls) == len(want) * len(layers)
    assert set(pinned_at.values()) == {pin} and len(pinned_at) == len(layers)
    n = max(len(w) for _s, w in calls)
    best = np.zeros(n)
    for _s, w in calls:
        best[: len(w)] = np.maximum(best[: len(w)], w)
    np.testing.assert_allclose(layers[0].passages.votes.votes[:n], best)


@pytest.mark.parametrize("seed", range(4))
def test_sorted_member_equals_numpy_isin(seed):
    """The pool's rows that a pinned passage also holds, found by binary search: the same
    answer as ``np.isin`` (its reference), -1 (an empty pool row) and rows past the table's
    ends included, and an empty table."""
    from icecache.cache.resident import sorted_member

    rng = np.random.default_rng(seed)
    table = np.sort(rng.choice(400, size=rng.integers(0, 60), replace=False)).astype(np.int64)
    x = rng.integers(-1, 420, size=(3, 97)).astype(np.int64)
    x[0, :len(table)] = table[::-1]  # every table row present somewhere
    assert np.array_equal(sorted_member(x, table), np.isin(x, table))


def test_a_whole_prompt_votes_with_its_last_queries_as_steps_would():
    """A prompt prefilled in chunks: each sparse layer's votes are, per offloaded row, the
    largest softmax weight of any query head at any of the prompt's last VOTE_STEPS positions
    (each position's queries scored alone, as a stepped token's are), and the passages are
    read from the first generated token's step."""
    import unittest.mock

    from icecache.cache.ice_layer import IceLayer
    from icecache.cache.spec import VOTE_STEPS

    seen: dict[int, list] = {}
    observe = IceLayer.observe

    def recorded(self, queries, positions=None):
        seen.setdefault(self.layer_idx, []).append((queries.detach().clone(), self.length))
        return observe(self, queries, positions)

    model = tiny_model("llama", 2)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 97, 230).tolist()
    cache = ice_cache(model, _spans(2, 1))
    with unittest.mock.patch.object(IceLayer, "observe", recorded):
        run_steps(model, cache, prompt, rng.integers(0, 97, 2).tolist())
    layers = cache.ice_layers()
    want = None  # the votes are shared by the layers: each row's best over all of them
    for layer in layers:
        assert layer.passages.pinned is not None
        q = torch.cat([c for c, _ in seen[layer.layer_idx]], dim=1)[:, -VOTE_STEPS:]  # (Hq, 32, d)
        assert seen[layer.layer_idx][-1][1] == len(prompt)
        H, d = layer.heads, q.shape[-1]
        scale = d ** -0.5
        n = layer.passages.votes.votes.shape[0]
        per = [spans.head_weights(q[:, i].reshape(H, -1, d), layer.store.keys, n, scale) for i in range(VOTE_STEPS)]
        best = np.max(per, axis=0)
        want = best if want is None else np.maximum(want, best)
    np.testing.assert_allclose(layers[0].passages.votes.votes, want, rtol=1e-5, atol=1e-7)
