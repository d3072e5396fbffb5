"""Positions past the trained context: RoPE re-rotation against the model's own RoPE, and the
remapped attention against a reference built from keys placed at their remapped positions."""

from __future__ import annotations

import pytest
import torch

from icecache.cache.paged import paged_decode_reference
from icecache.cache.placement import behind_pinned, placed, placing_order
from icecache.cache.positions import Remap, RopeFrame, choose, remap_decode

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024},
}


def llama(rope: dict, head_dim: int = 32):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters=dict(rope))
    return tf.LlamaForCausalLM(cfg).eval()


def model_rope(model, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (H, n, d) rotated by the model's own rotary embedding at ``positions`` (n,)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = model.model.rotary_emb(x[None], positions[None])
    out, _ = apply_rotary_pos_emb(x[None], x[None], cos, sin)
    return out[0]


@pytest.mark.parametrize("rope", list(ROPES))
def test_rerotation_equals_rope_at_the_new_position(rope):
    model = llama(ROPES[rope])
    frame = RopeFrame.from_model(model)
    assert frame.rope_type == rope and frame.composable
    assert frame.trained == ROPES[rope].get("original_max_position_embeddings", 4096)
    x = torch.randn(2, 6, 32)
    src = torch.tensor([0, 5, 1000, 4096, 70_000, 250_000])
    dst = torch.tensor([3, 40, 17, 9000, 64, 131_072])
    at_src = model_rope(model, x, src)
    moved = frame.rotate(at_src, src, dst)
    torch.testing.assert_close(moved, model_rope(model, x, dst), atol=2e-4, rtol=1e-4)
    # back to position 0 and forth again (the host store's position-free frame)
    torch.testing.assert_close(frame.rotate(frame.rotate(at_src, src, 0), 0, dst), model_rope(model, x, dst),
                               atol=2e-4, rtol=1e-4)
    # one position for all rows
    torch.testing.assert_close(frame.rotate(model_rope(model, x, src), src, 77),
                               model_rope(model, x, torch.full((6,), 77)), atol=2e-4, rtol=1e-4)
    # a run of positions to one (an evicted page to the position-free frame): the general
    # rotation's values to the bit, the second call from the rotation kept by the first
    run = torch.arange(5000, 5006)
    at_run = model_rope(model, x, run)
    for _ in range(2):
        assert torch.equal(frame.rotate_run(at_run, 5000, 0), frame.rotate(at_run, run, 0))
    torch.testing.assert_close(frame.rotate_run(at_run, 5000, 0), model_rope(model, x, torch.zeros(6, dtype=torch.long)),
                               atol=2e-4, rtol=1e-4)


def test_dynamic_rope_is_not_remapped():
    model = llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    frame = RopeFrame.from_model(model)
    assert not frame.composable
    assert choose("auto", frame, 10**6) == "true"
    with pytest.raises(ValueError, match="dynamic"):
        choose("remap", frame, 10)


def test_automatic_choice_remaps_only_past_the_trained_context():
    frame = RopeFrame(torch.ones(4), trained=8192)
    assert choose("auto", frame, 8192) == "true" and choose("auto", frame, 8193) == "remap"
    assert choose("true", frame, 10**6) == "true" and choose("remap", frame, 10) == "remap"
    assert choose("auto", None, 10**6) == "true"
    with pytest.raises(ValueError):
        choose("sometimes", frame, 10)


def test_remap_decode_equals_keys_placed_at_their_remapped_positions():
    """Sink j at distance D + s - j, pool rows (stored un-rotated) at distance D, window rows at
    their true distance: rotating the query per region equals rotating every key to its place."""
    model = llama(ROPES["llama3"])
    frame = RopeFrame.from_model(model)
    torch.manual_seed(3)
    H, G, d, s, P, W = 2, 3, 32, 4, 12, 6
    pos = 30_000  # the query's true position (the reference's float32 angles lose precision far beyond)
    D = 20
    raw = torch.randn(H, s + P + W, d)
    sink_pos = torch.arange(s)
    win_pos = torch.arange(pos - W, pos)
    k = torch.cat([model_rope(model, raw[:, :s], sink_pos), raw[:, s : s + P],  # pool: un-rotated
                   model_rope(model, raw[:, s + P :], win_pos)], dim=1)
    v = torch.randn(H, s + P + W, d)
    valid = torch.rand(H, s + P + W) > 0.2
    valid[:, -1] = True
    q0 = torch.randn(H * G, 1, d)
    q = model_rope(model, q0, torch.tensor([pos]))[:, 0].reshape(H, G, d)
    remap = Remap(frame, D)
    got = remap_decode(remap.query_regions(q, pos, D + s, D), k, v, valid, s, s + P, 0.125)
    # reference: every key at its remapped position, the query at its true one
    placed = torch.cat([model_rope(model, raw[:, :s], pos - (D + s - sink_pos)),
                        model_rope(model, raw[:, s : s + P], torch.full((P,), pos - D)),
                        model_rope(model, raw[:, s + P :], win_pos)], dim=1)
    want = paged_decode_reference(q, placed, v, valid, 0.125)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)


def test_auto_positions_in_make_cache():
    from icecache.errors import UsageError
    from icecache.methods import make_cache

    from .lab import lab_settings

    model = llama(ROPES["default"])  # trained on 4096 positions
    s = lab_settings(page_size=4, budget=16, sink_pages=1, window_pages=1, dense_layers=1, max_context=8192)
    assert make_cache("ice", model, s, tokens=4096).remap is None
    remapped = make_cache("ice", model, s, tokens=4097)
    assert remapped.remap is not None and remapped.remap.page_distance == 0  # no sliding window
    assert make_cache("ice", model, s.replace(positions="true"), tokens=10**6).remap is None
    make_cache("full", model, s, tokens=10**6)  # auto: full keeps true positions
    with pytest.raises(UsageError, match="paged"):
        make_cache("full", model, s.replace(positions="remap"))


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("dense_layers", [0, 1])
def test_remapped_store_holds_the_same_keys_in_a_position_free_frame(sparse, dense_layers):
    """Layer 0's keys depend on the tokens only, so both runs compute the same ones: the remapped
    cache keeps its offloaded keys un-rotated (host store and index) and gives back the true ones,
    through a prefill (sparse: chunk by chunk) and decode steps with window evictions."""
    import numpy as np

    from icecache.methods import make_cache

    from .lab import lab_settings

    model = llama(ROPES["llama3"])
    rng = np.random.default_rng(4)
    prompt, forced = rng.integers(0, 97, 300).tolist(), rng.integers(0, 97, 20).tolist()
    s = lab_settings(page_size=4, budget=16, sink_pages=2, window_pages=2, chunk_size=64,
                 prefill_budget=16, prefill_queries=4, dense_window=32, max_context=8192,
                 prefill="sparse" if sparse else "full", host_dtype="float32", dense_layers=dense_layers)
    caches = {}
    for mode in ("true", "remap"):
        cache = make_cache("ice", model, s.replace(positions=mode))
        with torch.inference_mode():
            cache.begin_prefill(len(prompt))
            for lo in range(0, len(prompt), 64):
                model(input_ids=torch.tensor([prompt[lo : lo + 64]]), past_key_values=cache, use_cache=True)
            cache.end_prefill()
            for t in forced:
                model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        caches[mode] = cache
    if dense_layers:  # layer 0 is a dense layer: it keeps every key at its true position
        dense = caches["remap"].layers[0]
        torch.testing.assert_close(dense.dense_kv()[0], caches["true"].layers[0].keys, atol=1e-4, rtol=1e-4)
        return
    true_layer, remap_layer = caches["true"].layers[0], caches["remap"].layers[0]
    assert remap_layer.remap is not None and remap_layer.store.rows == true_layer.store.rows > 200
    k_true, _ = true_layer.dense_kv()
    k_remap, _ = remap_layer.dense_kv()
    torch.testing.assert_close(k_remap, k_true, atol=1e-4, rtol=1e-4)
    # made on a named device (the host, as a GPU's bench hands them over): the same rows
    for cache in caches.values():
        for (k, v), (hk, hv) in zip(cache.dense_kv(), cache.dense_kv("cpu"), strict=True):
            assert torch.equal(hk, k) and torch.equal(hv, v)
    # the host store really is position-free: its rows are the keys rotated back to position 0
    first = remap_layer.resident.sink_fill
    rows = remap_layer.store.rows
    at_zero = RopeFrame.from_model(model).rotate(true_layer.store.keys[:, :rows], torch.arange(first, first + rows), 0)
    torch.testing.assert_close(remap_layer.store.keys[:, :rows], at_zero, atol=1e-4, rtol=1e-4)
    # later layers attend differently (pages and sink moved closer): the outputs are not the same
    assert not torch.equal(caches["true"].layers[1].dense_kv()[1], caches["remap"].layers[1].dense_kv()[1])


def test_automatic_prefill_and_positions_choice():
    from icecache.methods import full_prefill_bytes, plan_run, prefill_mode

    from .lab import lab_settings

    model = llama(ROPES["default"])  # trained on 4096 positions
    s = lab_settings(prefill="auto", max_context=10**6)
    assert prefill_mode("ice", model, s, 4096) == "full" and prefill_mode("ice", model, s, 4097) == "sparse"
    assert prefill_mode("full", model, s, 10**5) == "full"  # it cannot prefill sparsely
    assert prefill_mode("ice", model, s.replace(prefill="full"), 10**5) == "full"  # as asked
    need = full_prefill_bytes(model, s, 3000)
    assert need > 2 * 2 * 4 * 64 * 3000  # at least the keys and values of both layers
    small = s.replace(host_memory_gib=need / 2**30)  # half of it is less than the prefill needs
    assert prefill_mode("ice", model, small, 3000) == "sparse"
    run = plan_run("ice", model, s, 4000, 200)
    assert (run.prefill, run.positions) == ("full", "remap")  # the generation goes past 4096
    run = plan_run("ice", model, s, 3000, 200)
    assert (run.prefill, run.positions) == ("full", "true")
    run = plan_run("full", model, s, 9000, 10)
    assert (run.prefill, run.positions) == ("full", "true")


@pytest.mark.parametrize("arch,sparse", [("llama3", False), ("llama3", True), ("gemma3", False), ("gemma3", True)])
def test_remap_with_room_for_every_page_equals_full(arch, sparse):
    """Pages placed in token order just beyond the window and the sink just before them are the
    true positions when every page is loaded: remapped ice then decodes exactly like full
    attention, through a (sparse) prefill and window evictions. Gemma 3's shape: window layers
    (left at their true positions) and a global layer with its own RoPE base (remapped), whose
    rest-estimate rows stay on (none is left out, so none counts); the cache's window as long as
    the model's sliding one (with a shorter one the pages sit beyond the model's window, not at
    their true places)."""
    import numpy as np

    from icecache.methods import make_cache
    from tests.test_ice_cache import tiny_model

    from .lab import lab_settings

    model = llama(ROPES["llama3"]) if arch == "llama3" else tiny_model("gemma3", 1)
    rng = np.random.default_rng(6)
    prompt, forced = rng.integers(0, 97, 300).tolist(), rng.integers(0, 97, 30).tolist()
    # (the window covers Gemma's sliding window of 24 tokens: the pages just beyond both)
    s = lab_settings(page_size=4, budget=512, sink_pages=2, window_pages=2 if arch == "llama3" else 6,
                 dense_layers=1, chunk_size=64,
                 prefill_budget=512, prefill_queries=4, dense_window=4096, max_context=8192,
                 prefill="sparse" if sparse else "full", host_dtype="float32", index_beam=100_000,
                 rest_estimate=True)  # (on Gemma 3's shape its rows stay under remap: none is left out)
    out = {}
    for method, positions in (("full", "true"), ("ice", "remap")):
        prefill = "full" if method == "full" else s.prefill
        cache = make_cache(method, model, s.replace(positions=positions, prefill=prefill))
        logits = []
        with torch.inference_mode():
            if hasattr(cache, "begin_prefill"):
                cache.begin_prefill(len(prompt))
            for lo in range(0, len(prompt), 64):
                r = model(input_ids=torch.tensor([prompt[lo : lo + 64]]), past_key_values=cache, use_cache=True)
            logits.append(r.logits[0, -1])
            for t in forced:
                r = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
                logits.append(r.logits[0, -1])
        out[method] = logits
        if method == "ice":
            assert cache.remap is not None and cache.ice_layers()[0].store.rows > 200
            assert not any(layer.passages is not None and layer.passages.pinned is not None for layer in cache.ice_layers())
            assert all(layer.kernel == ("rest" if arch == "gemma3" else "plain") for layer in cache.ice_layers())
    for a, b in zip(out["full"], out["ice"], strict=True):
        torch.testing.assert_close(b, a, atol=3e-4, rtol=1e-4)


def test_sparse_prefill_steps_through_the_prompt_end():
    from icecache.generation import chunk_bounds
    from icecache.methods import tail_steps

    assert chunk_bounds(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(3, 5, 4) == [(3, 5)]
    assert tail_steps("sparse", 16, 5000) == 32
    assert tail_steps("sparse", 16, 20) == 19  # one token at least goes through the chunks
    assert tail_steps("full", 16, 5000) == 0


def test_sparse_prefill_runs_its_tail_as_decode_steps(cpu_settings, loaded, monkeypatch):
    """The prompt's last tokens reach the cache one at a time (each a decode step choosing
    tail_budget's pages), the rest in chunks; the logits are those of the last prompt token
    either way; generated tokens select the decode budget."""
    from icecache.cache.ice_layer import IceLayer
    from icecache.generation import Session
    from icecache.methods import tail_steps
    from icecache.textgen import generated_text

    asked = []  # (layer, query rows, pages) of every selection
    wides = []  # (layer, query rows, wide)
    flags = []  # (layer, prefill): the sparse prefill's choices (chunks and tail) vs decode steps'
    real_select = IceLayer.select

    def spy(layer, q, pages=None, wide=0.0, prefill=False):
        flags.append((layer.layer_idx, prefill))
        asked.append((layer.layer_idx, q.shape[0], layer.spec.budget_pages if pages is None else pages))
        wides.append((layer.layer_idx, q.shape[0], wide))
        return real_select(layer, q, pages, wide, prefill)

    monkeypatch.setattr(IceLayer, "select", spy)

    ids = loaded.tokenizer(generated_text(600, seed=3))["input_ids"][:900]
    settings = cpu_settings.replace(chunk_size=256, prefill="sparse", prefill_budget=256,
                                    dense_window=512, budget=64, prefill_queries=4, tail_budget=128)
    sizes = []
    s = Session(loaded, settings, "ice")
    real = s.forward
    s.forward = lambda part: (sizes.append(len(part)), real(part))[1]
    s.new_tokens = 4
    logits, stats = s.prefill(ids)
    steps = tail_steps("sparse", 4, len(ids))
    assert steps == 8 and sizes[-steps:] == [1] * steps and min(sizes[:-steps]) > 1
    assert sum(sizes) == len(ids) == len(s.cached_ids) and stats.tokens_prefilled == len(ids)
    first = min(layer for layer, _, _ in asked)
    mine = [(rows, pages) for layer, rows, pages in asked if layer == first]
    heads = loaded.model.config.num_attention_heads
    steps_asked = [pages for rows, pages in mine if rows == heads]
    assert steps_asked == [128 // 16] * steps  # the tail: tail_budget's pages, not the decode budget's
    # the tail's searches cover every key (tail_beam_frac 1); the chunks' use the beam
    assert [w for layer, rows, w in wides if layer == first and rows == heads] == [1.0] * steps
    assert {w for layer, rows, w in wides if rows != heads} == {0.0}
    assert {f for layer, f in flags} == {True}  # chunks and tail steps choose as a prefill
    s.decode(logits, 3)
    decoded = [pages for layer, _, pages in asked if layer == first][len(mine):]
    assert decoded and decoded == [64 // 16] * len(decoded)  # generated tokens: the budget
    # the answer's tokens search with the decode beam
    assert [w for layer, _, w in wides if layer == first][len(mine):] == [0.0] * len(decoded)
    assert [f for layer, f in flags if layer == first][len(mine):] == [False] * len(decoded)
    held = Session(loaded, settings, "ice")
    held.new_tokens = 4
    assert held.prefill(ids, hold_tail=True)[0] is None and len(held.cached_ids) == len(ids) - steps
    torch.testing.assert_close(held.finish_prefill(), logits)
    with pytest.raises(ValueError, match="no prefill to finish"):
        held.finish_prefill()


@pytest.mark.parametrize("rope,keep", [("default", -1), ("llama3", -1), ("default", 500)])
def test_placed_keys_decode_equals_the_region_reference(rope, keep):
    """The decode step's fast path (place_keys: one rotation of the sink and pool rows, then
    the fused attention with the query at its true position) equals the reference that rotates
    the query per region (remap_decode), with token-order offsets per head."""
    from icecache.cache.paged import (
        paged_decode_placed,
        paged_decode_placed_rows,
        paged_decode_reference,
        paged_decode_sdpa,
    )
    from icecache.cache.positions import ordered_offsets, place_keys, place_tables

    model = llama(ROPES[rope])
    frame = RopeFrame.from_model(model)
    torch.manual_seed(5)
    H, G, d, s_cap, s, P, W = 3, 3, 32, 6, 4, 16, 7
    pos, D = 50_000, 8
    L = s_cap + P + W
    raw = torch.randn(H, L, d)
    win_pos = torch.arange(pos - W + 1, pos + 1)
    k = torch.cat([model_rope(model, raw[:, :s_cap], torch.arange(s_cap)), raw[:, s_cap : s_cap + P],
                   model_rope(model, raw[:, s_cap + P :], win_pos)], dim=1)
    v = torch.randn(H, L, d)
    valid = torch.zeros(H, L, dtype=torch.bool)
    valid[:, :s] = True
    valid[:, s_cap : s_cap + P] = torch.rand(H, P) > 0.3
    valid[:, s_cap + P :] = True
    rows = torch.randperm(1000)[: H * P].reshape(H, P).numpy()  # host rows of the pool slots
    offset, count = ordered_offsets(rows, valid[:, s_cap : s_cap + P].numpy(), 999, keep)
    q = model_rope(model, torch.randn(H * G, 1, d), torch.tensor([pos]))[:, 0].reshape(H, G, d)
    placed = place_keys(frame, k, s, s_cap, s_cap + P, pos - D, offset, count)
    got = paged_decode_sdpa(q, placed, v, valid, 0.125)
    # reference: queries per region (sink at D + count + s - 1 - j, pool rows at D + offset)
    cos, sin = frame.down_table(0, int(offset.max()) + 1)  # rotations from 0 to 0, -1, -2, ...
    pool_k = frame.rotate_by(k[:, s_cap : s_cap + P], cos[offset], sin[offset])
    qs = Remap(frame, D).query_regions(q, pos, D + count + s - 1, D)
    want = remap_decode(qs, k, v, valid, s_cap, s_cap + P, 0.125, pool_k)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)
    assert torch.equal(placed[:, s_cap + P :], k[:, s_cap + P :])  # the window untouched
    # the CPU kernel that turns each row as it scores it (no placed copy), capped scores too
    where = (frame, s, s_cap, s_cap + P, pos - D, offset, count)
    torch.testing.assert_close(paged_decode_placed(q, k, v, valid, 0.125, None, *where), got, atol=1e-5, rtol=1e-4)
    capped = paged_decode_reference(q, placed, v, valid, 0.125, 2.0)
    assert not torch.allclose(capped, got, atol=1e-3)
    torch.testing.assert_close(paged_decode_placed(q, k, v, valid, 0.125, 2.0, *where), capped, atol=1e-5, rtol=1e-4)
    # the same kernel over a pool's own NumPy arrays (an ice layer's CPU step), placement as tables
    tables = place_tables(*where)
    for cap, want in ((None, got), (2.0, capped)):
        rows = paged_decode_placed_rows(q, k.numpy(), v.numpy(), valid.numpy(), 0.125, cap, tables)
        torch.testing.assert_close(rows, want, atol=1e-5, rtol=1e-4)


def test_ordered_offsets_pack_rows_one_apart():
    """Rows in token order, one position apart; invalid rows lie past the valid rows' span; the
    span bounds the sink's place. Against a plain loop."""
    import numpy as np

    from icecache.cache.positions import ordered_offsets

    rng = np.random.default_rng(3)
    for _ in range(50):
        H, n = int(rng.integers(1, 4)), int(rng.integers(1, 30))
        rows = np.stack([rng.permutation(400)[:n] for _ in range(H)])
        valid = rng.random((H, n)) < 0.7
        offset, span = ordered_offsets(rows, valid)
        for h in range(H):
            live = sorted((rows[h, i], i) for i in range(n) if valid[h, i])
            want, at = {}, 0
            for j in range(len(live) - 1, -1, -1):
                want[live[j][1]] = at
                if j:
                    at += min(live[j][0] - live[j - 1][0], 1)
            assert {i: int(offset[h, i]) for i in want} == want
            assert int(span[h]) == (max(want.values()) + 1 if want else 0)
            assert all(int(offset[h, i]) >= int(span[h]) for i in range(n) if not valid[h, i])
    rows, valid = np.array([[10, 3, 4, 50, 11]]), np.ones((1, 5), bool)
    assert ordered_offsets(rows, valid)[0].tolist() == [[2, 4, 3, 0, 1]]


def test_ordered_offsets_kernel_equals_the_numpy_reference():
    """The numba offsets (what the decode step uses) equal the NumPy reference exactly, invalid
    rows' offsets included, over keeps and tops."""
    import numpy as np

    from icecache.cache.positions import ordered_offsets, ordered_offsets_reference

    rng = np.random.default_rng(6)
    for top, keep in ((0, -1), (399, -1), (399, 0), (399, 37), (399, 399), (200, 500), (-1, -1)):
        for _ in range(25):
            H, n = int(rng.integers(1, 4)), int(rng.integers(1, 40))
            rows = np.stack([rng.permutation(400)[:n] for _ in range(H)]).reshape(H, n)
            valid = rng.random((H, n)) < rng.random()
            got, want = ordered_offsets(rows, valid, top, keep), ordered_offsets_reference(rows, valid, top, keep)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype == torch.int64
                assert torch.equal(a, b), (top, keep, rows, valid)


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_place_keys_kernel_equals_the_torch_reference(rope):
    """place_keys's numba pass (float32 on the CPU) equals its torch ops: rows turned by their
    table rows, the window copied as it is; a partial rotary dim leaves the other channels."""
    import numpy as np

    from icecache.cache.positions import ordered_offsets, place_keys

    frame = RopeFrame.from_model(llama(ROPES[rope]))
    rng = np.random.default_rng(2)
    for rotary in (None, frame.rotary_dim // 2):
        fr = frame if rotary is None else RopeFrame(frame.inv_freq[: rotary // 2].clone(), frame.trained, frame.rope_type)
        for _ in range(10):
            H, s_cap, P, W, d = 3, 6, int(rng.integers(1, 40)), 9, 32
            k = torch.randn(H, s_cap + P + W, d)
            valid = rng.random((H, P)) < 0.8
            rows = np.stack([rng.permutation(5000)[:P] for _ in range(H)])
            # rows within a random keep of the last at their true (far) offsets, the rest packed
            offset, count = ordered_offsets(rows, valid, 4999, int(rng.integers(-1, 5000)))
            pages_at = int(rng.integers(5000, 90_000))
            fast = place_keys(fr, k, 4, s_cap, s_cap + P, pages_at, offset, count)
            ref = place_keys(fr, k, 4, s_cap, s_cap + P, pages_at, offset, count, fast=False)
            torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-6)
            assert not torch.equal(fast[:, :s_cap], k[:, :s_cap])  # the sink did turn
            assert torch.equal(fast[:, s_cap + P :], k[:, s_cap + P :])


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_rotation_tables_are_the_rotations_to_each_position_step_after_step(rope):
    """down_table / down_arrays, served from one table kept across steps: bit for bit the
    rotations from 0 to top, top - 1, ... made afresh, as top moves up a step at a time, jumps
    past the kept rows, and a step asks for more rows (negative positions included)."""
    import numpy as np

    frame = RopeFrame.from_model(llama(ROPES[rope]))
    top, n = 40, 12
    for step in range(700):
        top += 1 if step % 100 else 997  # jumps past the table's first row now and then
        n = 3000 if step == 350 else 12 + step % 50  # one step needs far more rows
        cos, sin = frame.down_table(top, n)
        want_cos, want_sin = frame.rotation(0, top - torch.arange(n))
        assert torch.equal(cos, want_cos.float()) and torch.equal(sin, want_sin.float()), (step, top, n)
        a_cos, a_sin = frame.down_arrays(top, n)
        assert np.array_equal(a_cos, cos.numpy()) and np.array_equal(a_sin, sin.numpy())


def test_ordered_offsets_keep_the_near_rows_true():
    """With ``keep``: rows at most ``keep`` before row ``top`` sit at their true offset
    ``top - row``, the farther ones follow the farthest kept row one position apart (the nearest
    row at 0 when none is kept); a keep reaching row 0 puts the span (the sink's place) at
    ``top + 1``, the sink's true place. Against a plain loop."""
    import numpy as np

    from icecache.cache.positions import ordered_offsets

    rng = np.random.default_rng(4)
    for keep in (-1, 0, 5, 40, 399, 500):
        for _ in range(30):
            H, n, top = int(rng.integers(1, 4)), int(rng.integers(1, 30)), 399
            rows = np.stack([rng.permutation(top + 1)[:n] for _ in range(H)])
            valid = rng.random((H, n)) < 0.7
            offset, span = ordered_offsets(rows, valid, top, keep)
            for h in range(H):
                live = sorted(((rows[h, i], i) for i in range(n) if valid[h, i]), reverse=True)
                want, at, prev = {}, None, None
                for row, i in live:  # nearest first
                    if top - row <= keep:
                        at = top - row
                    elif at is None:
                        at = 0
                    else:
                        at += min(prev - row, 1)
                    want[i], prev = at, row
                assert {i: int(offset[h, i]) for i in want} == want, keep
                if keep >= top:
                    assert int(span[h]) == top + 1
                else:
                    assert int(span[h]) == (max(want.values()) + 1 if want else 0)
    rows, valid = np.array([[10, 3, 4, 50, 11]]), np.ones((1, 5), bool)
    # top 60, keep 50: rows 50, 11, 10 at their true offsets 10, 49, 50; rows 4 and 3 after them
    assert ordered_offsets(rows, valid, 60, 50)[0].tolist() == [[50, 52, 51, 10, 49]]
    assert ordered_offsets(rows, valid, 60, 0)[0].tolist() == ordered_offsets(rows, valid)[0].tolist()


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_placed_keys_keep_near_rows_at_their_true_positions(rope):
    """Pool rows (stored un-rotated) within ``keep`` of the window land exactly where the model
    puts them (RoPE at their true positions); a keep covering the whole store also leaves the
    sink where it is: the placed keys are then the keys of true positions."""
    from icecache.cache.positions import ordered_offsets, place_keys

    model = llama(ROPES[rope])
    frame = RopeFrame.from_model(model)
    torch.manual_seed(8)
    H, d, s_cap, s, P, W, D = 2, 32, 5, 4, 12, 6, 9
    pos = 900  # the query's position; the pool rows end D before it
    pages_at = pos - D
    top = pages_at - s  # the host row of the token at pages_at
    L = s_cap + P + W
    raw = torch.randn(H, L, d)
    k = torch.cat([model_rope(model, raw[:, :s_cap], torch.arange(s_cap)), raw[:, s_cap : s_cap + P],
                   model_rope(model, raw[:, s_cap + P :], torch.arange(pos - W + 1, pos + 1))], dim=1)
    valid = torch.rand(H, P) > 0.2
    rows = torch.stack([torch.randperm(top + 1)[:P] for _ in range(H)]).numpy()
    for keep in (300, 10_000):
        offset, count = ordered_offsets(rows, valid.numpy(), top, keep)
        placed = place_keys(frame, k, s, s_cap, s_cap + P, pages_at, offset, count)
        checked = 0
        for h in range(H):
            for i in range(P):
                if valid[h, i] and top - rows[h, i] <= keep:
                    want = model_rope(model, raw[h : h + 1, s_cap + i : s_cap + i + 1],
                                      torch.tensor([s + int(rows[h, i])]))[0, 0]
                    torch.testing.assert_close(placed[h, s_cap + i], want, atol=2e-5, rtol=1e-4)
                    checked += 1
        assert checked > (5 if keep == 300 else H * P // 2)
        if keep >= top:
            torch.testing.assert_close(placed[:, :s], k[:, :s], atol=2e-5, rtol=1e-4)
        else:  # the sink is placed just beyond the farthest row, not at its own positions
            assert not torch.allclose(placed[:, :s], k[:, :s], atol=1e-3)


def test_remapped_prompt_within_sink_and_window_then_decode():
    """A remapped run whose prompt fits in the sink and the window offloads nothing at its
    first step (an empty store, the cpu profile's 8-page window over a short prompt): no
    rotation of zero keys, and the later steps offload and place pages as usual."""
    import numpy as np

    from icecache.methods import make_cache

    from .lab import lab_settings

    model = llama(ROPES["llama3"])
    rng = np.random.default_rng(6)
    prompt, forced = rng.integers(0, 97, 20).tolist(), rng.integers(0, 97, 30).tolist()
    s = lab_settings(page_size=4, budget=8, sink_pages=1, window_pages=8, chunk_size=64, max_context=8192,
                 host_dtype="float32", dense_layers=0, positions="remap")
    cache = make_cache("ice", model, s)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        for t in forced:
            out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.remap is not None and layer.store.rows > 0  # pages left the window later
    assert torch.isfinite(out.logits).all()


def remapped_pinned_cache(seed: int, steps: int, prefill_budget: int):
    """An ice cache of the llama3-RoPE tiny model with remapped positions and two answer passages
    pinned: a 300-token sparse prefill from ``seed``, then ``steps`` one-token steps. Returns the
    model, the cache and the last step's logits."""
    import numpy as np

    from icecache.methods import make_cache

    from .lab import lab_settings

    model = llama(ROPES["llama3"])
    rng = np.random.default_rng(seed)
    prompt, forced = rng.integers(0, 97, 300).tolist(), rng.integers(0, 97, steps).tolist()
    s = lab_settings(page_size=4, budget=16, sink_pages=2, window_pages=2, dense_layers=1, chunk_size=64,
                 prefill_budget=prefill_budget, prefill_queries=4, dense_window=4096, max_context=8192,
                 prefill="sparse", host_dtype="float32", positions="remap", answer_spans=2)
    cache = make_cache("ice", model, s)
    with torch.inference_mode():
        cache.begin_prefill(len(prompt))
        for lo in range(0, len(prompt), 64):
            model(input_ids=torch.tensor([prompt[lo : lo + 64]]), past_key_values=cache, use_cache=True)
        for t in forced:
            out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
    return model, cache, out.logits


def test_pin_gap_moves_the_sink_and_the_budgets_rows_behind_the_pinned_passages():
    """``remap_pin_gap``: the passages nearest the window keep their places; the sink, the
    budget's selected rows and a passage that stays with the sink go G positions farther back
    (their placed keys are the same keys turned by G more). The passages are ordered by votes,
    the best nearest the window. When the best passage continues the sink, nothing moves. A gap
    past the trained context's room is cut to what fits."""
    import dataclasses

    import numpy as np

    from icecache.cache.positions import ordered_offsets
    from icecache.cache.spec import SPAN_PAGES

    _model, cache, _logits = remapped_pinned_cache(7, 6, 64)
    layer = cache.ice_layers()[0]
    r = layer.resident
    k, _v, valid = r.tensors()
    pages_at = layer.length - 1 - r.window_fill
    base, frame, G = layer.remap, layer.remap.frame, 40
    cut = (r.pool_pages - r.pinned_slots) * r.page_size
    pool_valid = np.asarray(valid[:, r.pool_at : r.window_at])

    def with_gap(gap, fn):
        layer.remap = dataclasses.replace(base, pin_gap=gap)
        try:
            return fn()
        finally:
            layer.remap = base

    def check(stay_below: int):
        # gaps 1 and 1 + G: the same order and layout, G apart
        a, b = with_gap(1, lambda: placed(k, r, layer.remap, layer.passages, layer.length, pages_at)), with_gap(1 + G, lambda: placed(k, r, layer.remap, layer.passages, layer.length, pages_at))
        far = pool_valid.copy()
        far[:, cut:] &= r.pool_row[:, cut:] < stay_below
        assert far.any() and (pool_valid & ~far).any()
        for h in range(k.shape[0]):
            still = r.pool_at + np.flatnonzero(pool_valid[h] & ~far[h])
            torch.testing.assert_close(b[h, still], a[h, still], atol=0, rtol=0)
            moved = np.concatenate([np.arange(r.sink_fill), r.pool_at + np.flatnonzero(far[h])])
            torch.testing.assert_close(b[h, moved], frame.rotate(a[h, moved], G, 0), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(b[:, r.window_at :], a[:, r.window_at :], atol=0, rtol=0)

    passages = layer.passages
    ids, table, rows = passages.load
    votes = passages.votes
    assert passages.pinned is not None and passages.lead == 0 and rows[0] >= SPAN_PAGES * r.page_size
    assert len(votes.anchors) == 2 and votes.best == votes.anchors[0]
    check(0)

    # the passages by votes: the best one's rows nearest the window, each passage in token order
    order = with_gap(G, lambda: placing_order(r, layer.remap, passages, pool_valid))
    pin_rows, pin_keys = r.pool_row[:, cut:], order[:, cut:]
    rank = votes.passage_rank(pin_rows)
    for h in range(k.shape[0]):
        ok = pool_valid[h, cut:]
        best, other = ok & (rank[h] == 0), ok & (rank[h] == 1)
        assert best.any() and other.any()
        assert pin_keys[h, best].min() > pin_keys[h, other].max()
        for part in (best, other):
            srt = np.argsort(pin_rows[h, part])
            assert (np.diff(pin_keys[h, part][srt]) > 0).all()
        assert order[h, :cut][pool_valid[h, :cut]].max() < pin_keys[h, ok].min()

    # a passage pinned at the sink (rows 2 .. 5 here): it and the rows before its end go back too
    near_sink = np.arange(2, 6)
    passages.load = (ids, table, np.concatenate([near_sink, rows]))
    assert with_gap(G, lambda: passages.with_sink(layer.remap.pin_gap)) == 6
    check(6)
    # ... unless the best passage is that one: then it and the sink stay near, and nothing moves
    top = pages_at - r.sink_fill
    room = frame.trained - (layer.length - pages_at) - r.sink_fill
    offset, count = ordered_offsets(with_gap(G, lambda: placing_order(r, layer.remap, passages, pool_valid)), pool_valid,
                                    top, -1)
    anchors = list(votes.anchors)
    votes.anchors = [3] + anchors
    try:
        same = with_gap(G, lambda: behind_pinned(offset, count, pool_valid, room, r, layer.remap, passages))
    finally:
        votes.anchors = anchors
    assert same[0] is offset and same[1] is count
    passages.load = (ids, table, rows)
    # cut to the room: nothing placed beyond the trained context
    offset, count = ordered_offsets(with_gap(10**6, lambda: placing_order(r, layer.remap, passages, pool_valid)), pool_valid,
                                    top, -1)
    moved, spanned = with_gap(10**6, lambda: behind_pinned(offset, count, pool_valid, room, r, layer.remap, passages))
    assert int(moved[torch.from_numpy(pool_valid)].max()) < room and int(spanned.max()) <= room


def test_pinned_placement_in_one_call_equals_its_numpy_reference():
    """placing's numba call (pinned passages) gives the offsets and spans of placing_order,
    ordered_offsets and behind_pinned: without a gap, with gaps that fit and that the room cuts,
    with a passage that stays with the sink, and when that passage is the best voted."""
    import dataclasses

    import numpy as np

    from icecache.cache.placement import placing

    _model, cache, _logits = remapped_pinned_cache(7, 6, 64)
    layer = cache.ice_layers()[0]
    r, passages, votes = layer.resident, layer.passages, layer.passages.votes
    base = layer.remap
    ids, table, rows = passages.load
    checked = set()
    for near_sink in (False, True):
        passages.load = (ids, table, np.concatenate([np.arange(2, 6), rows]) if near_sink else rows)
        for best_at_sink in (False, True):
            anchors = list(votes.anchors)
            if best_at_sink:
                votes.anchors = [3] + anchors
            try:
                for gap in (0, 1, 40, 10**6):
                    layer.remap = dataclasses.replace(base, pin_gap=gap)
                    for back in (1, 40, 400):  # the query's distance from the pages
                        pages_at = layer.length - back
                        fast = placing(r, layer.remap, passages, layer.length, pages_at)
                        ref = placing(r, layer.remap, passages, layer.length, pages_at, fast=False)
                        assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])
                        checked.add(ref[1].tolist().__repr__())
            finally:
                layer.remap = base
                votes.anchors = anchors
    passages.load = (ids, table, rows)
    assert len(checked) >= 4  # the cases gave different layouts


def test_placed_decode_in_one_call_equals_placing_then_the_placed_kernel():
    """An ice layer's remapped CPU step in one numba call (placed_decode: the placement, then the
    attention with each row turned as it is scored) gives the output of the reference placement
    (placing's NumPy path) and the placed kernel over its tables: with the pinned passages and
    without, capped scores or not, the query near the pages and far; a table too short for the
    placement writes nothing and says how many rows it needs."""
    import numpy as np

    from icecache.cache.kernels import placed_decode
    from icecache.cache.paged import paged_decode_placed_rows
    from icecache.cache.placement import placing, placing_args
    from icecache.cache.positions import place_tables, table_rows

    model, cache, _logits = remapped_pinned_cache(7, 6, 64)
    layer = cache.ice_layers()[0]
    r, frame = layer.resident, layer.remap.frame
    rows = r.cpu_rows()
    assert rows is not None
    G = model.config.num_attention_heads // layer.heads
    q = torch.randn(layer.heads, G, rows[0].shape[2], generator=torch.Generator().manual_seed(3))
    for passages in (layer.passages, None):
        for back in (1, 40, 400):
            pages_at = layer.length - back
            offset, count = placing(r, layer.remap, passages, layer.length, pages_at, fast=False)
            tables = place_tables(frame, r.sink_fill, r.pool_at, r.window_at, pages_at, offset, count)
            args = placing_args(r, layer.remap, passages, layer.length, pages_at)
            for cap in (None, 2.0):
                want = paged_decode_placed_rows(q, *rows, r.valid, 0.125, cap, tables)
                out = np.full(q.shape, 7.0, np.float32)
                call = (q.numpy(), *rows, r.valid, np.float32(0.125), np.float32(cap or 0.0), out, args,
                        r.sink_fill, r.pool_at)
                need = placed_decode(*call, *frame.down_arrays(pages_at, 1), frame.rotary_dim)
                assert need > 1 and table_rows(need, r.window_at) == tables[4].shape[0]  # place_tables' rows
                assert (out == 7.0).all()
                assert placed_decode(*call, *frame.down_arrays(pages_at, need), frame.rotary_dim) == 0
                torch.testing.assert_close(torch.from_numpy(out), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,sink,window,cap", [(700, 4, 256, None), (700, 4, 256, 3.0), (100, 4, 256, None),
                                                  (3, 4, 256, None), (900, 0, 300, None)])
def test_remapped_dense_layer_decodes_in_one_call_as_its_regions(rows, sink, window, cap):
    """A remapped dense layer's decode step in one numba call (the sink's rows, then the window's,
    each region with its own query) equals the regions' products (attend_regions): with the
    window cut and uncut, a sink, none, and capped scores."""
    from icecache.cache.positions import RemapDenseLayer

    frame = RopeFrame.from_model(llama(ROPES["default"]))
    torch.manual_seed(rows + sink)
    H, G, d = 3, 3, 32
    layer = RemapDenseLayer(Remap(frame, 16), sink, window)
    layer.update(torch.randn(1, H, rows - 1, d), torch.randn(1, H, rows - 1, d))
    layer.update(torch.randn(1, H, 1, d), torch.randn(1, H, 1, d))  # the step's own row
    query = torch.randn(1, H * G, 1, d)
    got = layer.attend(query, 0.2, cap)
    layer._fused = lambda *args: None  # the regions' products
    want = layer.attend(query, 0.2, cap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
