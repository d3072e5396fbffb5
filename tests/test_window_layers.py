"""A model's own sliding-window layers (Gemma 3's shape): every cache keeps their window only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.cache.window import WindowLayer, kv_in_order, window_sizes
from icecache.measure import window_kv
from icecache.methods import METHODS, make_cache
from tests.test_ice_cache import tiny_model
from tests.test_pinned import SETTINGS

PROMPT = np.random.default_rng(3).integers(0, 97, 200).tolist()  # past the window of 24 tokens
STEPS = 16


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3", 1)


@torch.inference_mode()
def run(model, method: str, settings) -> tuple[list[torch.Tensor], object]:
    """The prompt in chunks, then ``STEPS`` greedy steps: each step's logits, and the cache."""
    cache = make_cache(method, model, settings, len(PROMPT) + STEPS, len(PROMPT))
    ice = getattr(cache, "begin_prefill", None) is not None
    if ice:
        cache.begin_prefill(len(PROMPT))
    for lo in range(0, len(PROMPT), settings.chunk_size):
        out = model(input_ids=torch.tensor([PROMPT[lo : lo + settings.chunk_size]]), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    if ice:
        cache.end_prefill()
    logits = []
    for _ in range(STEPS):
        logits.append(out.logits[0, -1].clone())
        t = int(torch.argmax(out.logits[0, -1]))
        out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
    return logits, cache


def test_window_sizes_follow_transformers_layer_kinds():
    import transformers as tf

    cfg = tf.Gemma3TextConfig(num_hidden_layers=6, sliding_window=512,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"])
    assert window_sizes(cfg, 6) == [512] * 5 + [0]
    assert window_sizes(tf.LlamaConfig(num_hidden_layers=3), 3) == [0, 0, 0]
    assert window_sizes(tf.MistralConfig(num_hidden_layers=2, sliding_window=4096), 2) == [4096, 4096]
    assert window_sizes(tf.MistralConfig(num_hidden_layers=2, sliding_window=None), 2) == [0, 0]


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_keeps_the_window_layers_to_their_window(gemma, method):
    """Each method runs the Gemma-3-shaped model past its window; the window layers hold less than
    the window (transformers' own cut), the global layer is the method's. ``dense`` holds
    everything in the global layer, so it decodes as ``full`` does; so does ``offloaded`` (on a
    CPU, transformers' cache without the offloading)."""
    logits, cache = run(gemma, method, SETTINGS)
    assert all(torch.isfinite(x).all() for x in logits)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds[:3] == [type(cache.layers[0])] * 3
    windows = cache.layers[:3]  # (a window layer's decode ring: the window; its rows in order: less)
    assert all(layer.keys.shape[2] <= 24 and kv_in_order(layer)[0].shape[2] < 24 for layer in windows)
    # what --stats reports of them: three layers, each at most its window of 24 rows
    layers, held = window_kv(cache)
    row = 2 * windows[0].keys.shape[1] * windows[0].keys.shape[3] * windows[0].keys.element_size()
    assert layers == 3 and 0 < held <= 3 * 24 * row
    if method not in ("full", "offloaded"):  # (transformers' own caches)
        assert all(isinstance(layer, WindowLayer) for layer in windows)
        assert not isinstance(cache.layers[3], WindowLayer)
        assert cache.device_kv_bytes() > 0
    if method in ("dense", "offloaded"):
        ref, _ = run(gemma, "full", SETTINGS)
        for a, b in zip(ref, logits, strict=True):
            torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


def test_a_model_without_window_layers_reports_none():
    _, cache = run(tiny_model("llama", 1), "ice", SETTINGS)
    assert window_kv(cache) == (0, 0) and window_kv(None) == (0, 0)


@pytest.mark.parametrize("method", ["ice", "streaming", "quest"])
def test_a_sparse_prefill_with_remapped_positions_runs_the_window_layers_as_they_are(gemma, method):
    logits, cache = run(gemma, method, SETTINGS.replace(prefill="sparse", positions="remap"))
    assert all(torch.isfinite(x).all() for x in logits)
    assert cache.remap is not None and cache.remap.frame is not None
    assert all(isinstance(layer, WindowLayer) and layer.in_order()[0].shape[2] < 24 for layer in cache.layers[:3])
    assert cache.remap.page_distance == 24  # the model's sliding window


def test_remapped_pages_end_beyond_the_sliding_window():
    """A remapped step's loaded pages end beyond the cache's window and beyond the model's
    sliding window, whichever is farther; a model without window layers: beyond the cache's."""
    from icecache.cache.positions import Remap, RopeFrame

    frame = RopeFrame.from_model(tiny_model("llama", 1))
    assert Remap(frame, 24).pages_end(100, 8) == 100 - 1 - 24
    assert Remap(frame, 24).pages_end(100, 30) == 100 - 1 - 30
    assert Remap(frame, 0).pages_end(100, 8) == 100 - 1 - 8


def test_remapped_positions_keep_the_rest_estimate_rows_on_a_model_with_window_layers(gemma):
    """Under remapped positions the estimate rows stay on where the model has sliding-window
    layers (placed past the pool) and the steps run through them; a model without them attends
    to the resident rows only."""
    s = SETTINGS.replace(prefill="sparse", positions="remap", rest_estimate=True)
    for model, kind in ((gemma, "rest"), (tiny_model("llama", 1), "plain")):
        logits, cache = run(model, "ice", s)
        assert all(torch.isfinite(x).all() for x in logits)
        paged = cache.ice_layers()
        assert paged and all(layer.kernel == kind for layer in paged)
        assert all((layer.rest is not None and layer.rest.npages > 0) == (kind == "rest") for layer in paged)


def test_the_memory_estimate_counts_a_window_layer_as_its_window():
    import transformers as tf

    from icecache.memory import need_bytes

    kinds = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    shape = dict(num_hidden_layers=18, num_key_value_heads=1, head_dim=256)
    windowed = tf.Gemma3TextConfig(**shape, sliding_window=512, layer_types=kinds)
    s = SETTINGS.replace(chunk_size=2048)
    per_token = 2 * 256 * 4  # keys and values of one layer and token, float32
    for method in ("full", "dense", "ice"):
        small, big = need_bytes(method, windowed, s, 32768).total, need_bytes(method, windowed, s, 65536).total
        # doubling the context adds nothing for the 15 window layers: only the 3 global layers grow
        # (full and dense: with a growing buffer's spare room and one layer's copy; ice: in the
        # host store, float16)
        grew = (big - small) / (3 * per_token * 32768)
        assert (0.5 if method == "ice" else 1.0) < grew < 1.6


def test_a_shared_prefill_keeps_each_window_layer_to_its_window(gemma, monkeypatch):
    """The eval's shared prefill keeps a window layer's window only, and hands over what a prefill
    keeping every row of every layer (the window layers then masked to their window) hands over:
    the same last logits, global layers' rows, window layers' last rows and recorded queries."""
    from types import SimpleNamespace

    import icecache.cache as cache_pkg
    from icecache.generation import prefill_once

    loaded = SimpleNamespace(model=gemma, tokenizer=SimpleNamespace(eos_token_id=None), end_ids=frozenset())
    windows = window_sizes(gemma.config, gemma.config.num_hidden_layers)
    assert any(windows) and not all(windows)
    kept = prefill_once(loaded, SETTINGS, PROMPT)

    class EveryRow(cache_pkg.DenseCache):
        def __init__(self, layers, decode_dtype=None, windows=None):
            super().__init__(layers, decode_dtype, None)

    monkeypatch.setattr(cache_pkg, "DenseCache", EveryRow)
    every = prefill_once(loaded, SETTINGS, PROMPT)
    assert torch.allclose(kept.logits, every.logits, atol=1e-4)
    for w, (k, v), (k_all, v_all) in zip(windows, kept.kv, every.kv, strict=True):
        assert k_all.shape[2] == len(PROMPT)
        assert k.shape[2] == (w - 1 if w else len(PROMPT))  # transformers' window layer: w - 1 rows
        for mine, theirs in ((k, k_all), (v, v_all)):
            assert torch.allclose(mine, theirs[:, :, -mine.shape[2]:], atol=1e-5)
    assert kept.obs_queries.keys() == every.obs_queries.keys()
    for i, q in kept.obs_queries.items():
        assert torch.allclose(q, every.obs_queries[i], atol=1e-5)


@pytest.mark.parametrize("method", [pytest.param("full", marks=pytest.mark.slow), "ice",
                                    pytest.param("quest", marks=pytest.mark.slow)])
def test_a_shared_prefill_adopted_with_window_layers_decodes_as_the_methods_own(gemma, method):
    """The eval's path (one dense prefill, adopted by each method's cache) continues at the
    prompt's true length in the window layers too, so it decodes as the method's own prefill."""
    from types import SimpleNamespace

    from icecache.generation import Session, prefill_once

    loaded = SimpleNamespace(model=gemma, tokenizer=SimpleNamespace(eos_token_id=None), end_ids=frozenset())
    own, _ = Session(loaded, SETTINGS, method).generate(PROMPT, STEPS)
    pre = prefill_once(loaded, SETTINGS, PROMPT)
    adopted, _ = Session(loaded, SETTINGS, method).generate_from(pre, STEPS)
    assert adopted == own


def test_the_decode_ring_holds_what_transformers_window_holds():
    """A window layer's ring (decode steps of one row) against transformers' own layer over the
    same rows: the same rows in position order (:meth:`WindowLayer.in_order`), the same attention
    of a query over the rows a step returns (their order aside), the same mask sizes; a prompt
    chunk after decode steps (the rows put back in order) and a copy go on alike."""
    import copy

    from transformers.cache_utils import DynamicSlidingWindowLayer

    g = torch.Generator().manual_seed(5)
    ours, theirs = WindowLayer(6), DynamicSlidingWindowLayer(6)

    def feed(rows: int):
        k, v = torch.randn(1, 2, rows, 4, generator=g), torch.randn(1, 2, rows, 4, generator=g)
        assert ours.get_mask_sizes(rows) == theirs.get_mask_sizes(rows)
        a, b = ours.update(k, v), theirs.update(k, v)
        q = torch.randn(1, 2, 1, 4, generator=g)
        assert torch.allclose(torch.softmax(q @ a[0].transpose(-1, -2), -1) @ a[1],
                              torch.softmax(q @ b[0][:, :, -a[0].shape[2]:].transpose(-1, -2), -1)
                              @ b[1][:, :, -a[0].shape[2]:], atol=1e-6)
        for x, y in zip(ours.in_order(), (theirs.keys, theirs.values), strict=True):
            assert torch.equal(x, y)

    for rows in [3, 1, 1, 1, 1, 1, 1, 1, 1, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]:
        feed(rows)
        if rows == 1:
            assert ours._ring is not None and ours.keys.shape[2] == min(ours.cumulative_length, 6)
    twin = copy.deepcopy(ours)
    assert torch.equal(twin.in_order()[0], ours.in_order()[0])
    ours = twin
    for rows in [1, 1, 5, 1]:
        feed(rows)
