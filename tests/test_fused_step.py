"""The fused decode layers (icecache/fused_step.py) against transformers' forward of the float
model over the same weights: 64 steps, within float tolerance, where the cache is dense."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from icecache import fast_step, fused_step
from icecache import weights as W
from icecache.cache.ice import IceCache
from icecache.fast_step import FastStep
from icecache.fused_step import FusedLayers, unfused
from icecache.methods import make_cache, prepare_model
from tests.test_fast_step import small_settings
from tests.test_ice_cache import tiny_model
from tests.test_weights import _four_bit_groups


def exact_int4(arch: str):
    """(float model, the same model with its exact int4 layers) of a tiny ``arch``; both with the
    float LM head (the checked head's logits other than the largest are int8's)."""
    model = tiny_model(arch)
    _four_bit_groups(model)
    float_model = copy.deepcopy(model)
    assert W.apply_weights(model, "auto") == "int4"
    model.lm_head = copy.deepcopy(float_model.lm_head)
    return float_model, model


def forced_logits(model, cache, prompt: list[int], forced: list[int], step=None) -> list[torch.Tensor]:
    """Prefill ``prompt`` by the model's forward, then ``forced`` one token at a time, through
    ``step`` (a FastStep) or the forward; the logits of each."""
    out = []
    with torch.inference_mode():
        for lo in range(0, len(prompt), 64):
            model(input_ids=torch.tensor([prompt[lo:lo + 64]]), past_key_values=cache, use_cache=True)
        for t in forced:
            if step is not None:
                out.append(step.step(t, cache).clone())
            else:
                r = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                out.append(r.logits[0, -1].clone())
    return out


def _dense_run(float_model, seed: int):
    """A run short enough to stay dense (a 90-token prompt, 64 forced tokens, ``dense_until``
    1024): (prompt, forced, settings, total tokens, the float model's logits of each forced step
    by transformers' forward)."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (90,), generator=g).tolist()
    forced = torch.randint(0, 97, (64,), generator=g).tolist()
    ref = forced_logits(float_model, DynamicCache(config=float_model.config), prompt, forced)
    return prompt, forced, small_settings(dense_until=1024), len(prompt) + len(forced) + 1, ref


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3"])
@pytest.mark.parametrize("method", ["dense", "ice", "full"])
def test_fused_layers_decode_as_the_float_forward(arch, method, monkeypatch):
    """``dense``, and ``ice`` on a run short enough to keep every layer dense, whole layers (Gemma:
    its window layers' rings, Gemma 2's capped scores, Gemma 3's RoPE per layer kind); ``full``
    (transformers' cache and attention) the layers' two parts around the cache's attention
    (qwen2: q/k/v biases; qwen3 and gemma3: per-head q/k norms; Gemma: norms by ``1 + weight``
    around attention and MLP, GELU): each of 64 steps' logits within float rounding of the float
    model's forward over the same values (the prompt longer than the tiny Gemmas' window of 24,
    so their rings wrap)."""
    float_model, model = exact_int4(arch)
    prompt, forced, settings, total, ref = _dense_run(float_model, seed=7)
    prepare_model(method, model, settings, total)
    calls, whole = [], []
    step = FastStep(model)
    name = "run_split" if method == "full" else "run_layers"
    real = getattr(fast_step, name)
    monkeypatch.setattr(fast_step, name, lambda *a: calls.append(1) or real(*a))
    one_call = fused_step.decoder_layers
    monkeypatch.setattr(fused_step, "decoder_layers", lambda *a: whole.append(1) or one_call(*a))
    cache = make_cache(method, model, settings, total)
    got = forced_logits(model, cache, prompt, forced, step)
    assert len(calls) == len(forced)  # every step fused
    assert len(whole) == (len(forced) if name == "run_layers" else 0)  # dense: every layer in one call
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        err = float((a - b).abs().max())
        assert err <= 1e-5 * float(a.abs().max()), f"{arch} {method} step {i}: {err:.2e}"
    if name == "run_layers":  # a fork of the cache (a second question) copies it without the step's buffer lists
        assert hasattr(cache.layers[0], "_fused_rows")
        twin = copy.deepcopy(cache)
        assert all(not hasattr(layer, "_fused_rows") for layer in twin.layers)
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, twin.layers, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("method", ["dense", "full"])
def test_int16_inputs_decode_near_the_float_forward(arch, method):
    """``decode_inputs: int16`` (icecache.int16_inputs): the two-a-byte layers' products take
    their input rounded to int16; 64 steps' logits stay within 1e-3 of the largest of the float
    model's forward (0.6-3.3e-4 seen on these random models; the float inputs: 1e-5, above), and
    they are not the float inputs' logits."""
    float_model, model = exact_int4(arch)
    fused = FusedLayers.of(model, rounded=True)
    assert all(layer[-1] for layer in fused.layers)
    assert any(2 * w.shape[1] == m.in_features for layer, mods in zip(fused.layers, fused.modules, strict=True)
               for w, m in zip(layer[2], mods, strict=True))  # some tiles two values a byte: rounded
    prompt, forced, settings, total, ref = _dense_run(float_model, seed=11)
    outs = {}
    for rounded in (False, True):
        model._icecache_int16_inputs = rounded
        prepare_model(method, model, settings, total)
        outs[rounded] = forced_logits(model, make_cache(method, model, settings, total), prompt, forced,
                                      FastStep(model))
    worst = max(float((a - b).abs().max()) / float(a.abs().max()) for a, b in zip(ref, outs[True], strict=True))
    assert worst <= 1e-3, f"{arch} {method}: {worst:.2e}"
    assert any(not torch.equal(a, b) for a, b in zip(outs[False], outs[True], strict=True))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_method_runs_the_split_layers_as_the_torch_step(arch, monkeypatch):
    """Every method (small pages and budgets, as tests/test_fast_step.py): the fused layers' two
    parts around the method's own cache and attention (whole layers where every cache layer is
    dense or a window) against the float model's torch step, within float rounding (no choice of
    pages moved); Gemma 3: its window layers beside the method's global ones, each run of window
    layers in one whole call between the split global layers (the ice methods' attention)."""
    from icecache.methods import names

    float_model, model = exact_int4(arch)
    g = torch.Generator().manual_seed(10)
    prompt = torch.randint(0, 97, (120,), generator=g).tolist()
    forced = torch.randint(0, 97, (8,), generator=g).tolist()
    settings = small_settings()
    total = len(prompt) + len(forced) + 1
    calls, whole, mixed = [], [], 0
    for name in ("run_split", "run_layers"):
        real = getattr(fast_step, name)
        monkeypatch.setattr(fast_step, name, lambda *a, _r=real: calls.append(1) or _r(*a))
    one_call = fused_step.decoder_layers
    monkeypatch.setattr(fused_step, "decoder_layers", lambda *a: whole.append(len(a[1])) or one_call(*a))
    for method in names():
        outs = []
        for m in (float_model, model):
            prepare_model(method, m, settings, total)
            cache = make_cache(method, m, settings, total)
            outs.append(forced_logits(m, cache, prompt, forced, FastStep(m)))
        for i, (a, b) in enumerate(zip(*outs, strict=True)):
            err = float((a - b).abs().max())
            assert err <= 1e-5 * float(a.abs().max()), f"{method} step {i}: {err:.2e}"
        if arch == "gemma3" and isinstance(cache, IceCache) and cache.ice_layers():
            # the three window layers before the global one in one call a step, the global one split
            assert whole == [3] * len(forced), method
            mixed += 1
        whole.clear()
    assert mixed or arch != "gemma3"  # (the paged methods: quest, snapkv, h2o, ...)
    assert len(calls) == len(names()) * len(forced)  # the int4 model's steps, every one fused


def test_not_fused_where_the_weights_do_not_allow(monkeypatch):
    """A float layer (no exact bytes), a paused step (the bench's linear clock): the torch step,
    bit for bit the forward."""
    calls = []
    for name in ("run_split", "run_layers"):
        real = getattr(fast_step, name)
        monkeypatch.setattr(fast_step, name, lambda *a, _r=real: calls.append(1) or _r(*a))
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 97, (70,), generator=g).tolist()
    forced = torch.randint(0, 97, (4,), generator=g).tolist()
    settings = small_settings(dense_until=1024)
    total = len(prompt) + len(forced) + 1

    plain = tiny_model("llama")
    W.apply_weights(plain, "auto")  # random weights: no layer holds in 4-bit groups
    assert FusedLayers.of(plain) is None
    _float, model = exact_int4("llama")
    assert FusedLayers.of(model) is not None
    for m, method, paused in ((plain, "dense", False), (plain, "full", False), (model, "dense", True),
                              (model, "ice", True)):
        prepare_model(method, m, settings, total)
        step = FastStep(m)
        caches = [make_cache(method, m, settings, total) for _ in range(2)]
        if paused:
            with unfused():
                got = forced_logits(m, caches[0], prompt, forced, step)
        else:
            got = forced_logits(m, caches[0], prompt, forced, step)
        ref = forced_logits(m, caches[1], prompt, forced)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), method
    assert calls == []


def test_fused_layers_are_current_until_a_layer_is_replaced():
    """``current`` (asked every step): true for the model they were made from, false once any
    of a layer's seven products is another module (the step then makes them anew)."""
    _float, model = exact_int4("llama")
    fused = FusedLayers.of(model)
    assert fused.current(model)
    layer = model.model.layers[-1]
    layer.mlp.up_proj = copy.deepcopy(layer.mlp.up_proj)
    assert not fused.current(model)
    assert FusedLayers.of(model).current(model)


def test_the_embedded_models_fused_steps_are_its_float_forward(loaded, monkeypatch):
    """The real weights (int4, exact: the GGUF's Q4_1 values) with ice keeping every layer dense:
    the fused layers' logits within float rounding of the float model's forward, through the
    same LM head, and the same greedy tokens."""
    from transformers import DynamicCache

    from icecache.config import resolve_settings
    from icecache.models import load_model

    int4 = load_model(None, resolve_settings("cpu", weights="int4", decode_inputs="float")).model
    int4.lm_head = loaded.model.lm_head  # (the float head: the checked head's other logits are int8's)
    ids = loaded.tokenizer(" ".join(f"Ship {i} docked at pier {i * 7 % 40} before noon." for i in range(40)))["input_ids"]
    forced = loaded.tokenizer(" The ship that docked at pier 14 was ship 2, then more ships came.")["input_ids"]
    settings = resolve_settings("cpu", weights="int4", decode_inputs="float").replace(chunk_size=256, dense_kv="model")
    total = len(ids) + len(forced) + 1
    ref = forced_logits(loaded.model, DynamicCache(config=loaded.model.config), ids, forced)
    prepare_model("ice", int4, settings, total)
    calls = []
    real = fast_step.run_layers
    monkeypatch.setattr(fast_step, "run_layers", lambda *a: calls.append(1) or real(*a))
    got = forced_logits(int4, make_cache("ice", int4, settings, total), ids, forced, FastStep(int4))
    assert len(calls) == len(forced)
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        err = float((a - b).abs().max())
        assert err <= 1e-4 * float(a.abs().max()), f"step {i}: {err:.2e}"
        assert int(a.argmax()) == int(b.argmax())


def _torch_and_fused(method: str, float_model, model, settings, prompt: list[int], forced: list[int], monkeypatch,
                     **cache_args):
    """``method``'s forced logits through the float model's torch step and through the int4
    model's fused layers, each over its own cache: (logits of both, the two caches, one entry for
    each one-call step of the fused layers, :func:`~icecache.fused_step.decoder_layers`)."""
    total = len(prompt) + len(forced) + 1
    outs, caches, whole = [], [], []
    one_call = fused_step.decoder_layers
    monkeypatch.setattr(fused_step, "decoder_layers", lambda *a: whole.append(1) or one_call(*a))
    for m in (float_model, model):
        prepare_model(method, m, settings, total)
        caches.append(make_cache(method, m, settings, total, **cache_args))
        outs.append(forced_logits(m, caches[-1], prompt, forced, FastStep(m)))
    return outs, caches, whole


@pytest.mark.parametrize("dense_kv", ["model", "bfloat16"])
def test_fused_layers_clamp_distances_past_the_trained_context_as_the_torch_step(dense_kv, monkeypatch):
    """A run whose prompt fits the trained context (the tiny model's 4096 positions) and whose
    generation goes past it, every layer dense with clamped distances: the fused layers (int4's
    exact values) against the torch step of the float model with the same cache, within float
    rounding, before and after the first clamped key; the layers' rows in float32, or in
    float16 keys and bfloat16 values (``dense_kv``: the fused layer rounds its new row as torch's
    copy into the buffer does, and reads them through the same kernel)."""
    float_model, model = exact_int4("llama")
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 97, (4088,), generator=g).tolist()
    forced = torch.randint(0, 97, (24,), generator=g).tolist()
    settings = small_settings(dense_until=8192, chunk_size=512, dense_kv=dense_kv)
    outs, caches, whole = _torch_and_fused("ice", float_model, model, settings, prompt, forced, monkeypatch,
                                           prompt_tokens=len(prompt))
    want = (torch.float32, torch.float32) if dense_kv == "model" else (torch.float16, torch.bfloat16)
    for cache in caches:
        assert cache.all_dense and cache.clamped
        assert all((layer._k.dtype, layer._v.dtype) == want for layer in cache.layers)
    assert FusedLayers.of(float_model) is None and FusedLayers.of(model) is not None
    # the steps within the trained context in one call, the clamped ones a call a layer
    assert len(whole) == 4096 - len(prompt)
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        err = float((a - b).abs().max())
        assert err <= 1e-5 * float(a.abs().max()), f"step {i}: {err:.2e}"  # (about 3e-7 here)


def test_float_rings_and_16_bit_layers_decode_in_one_call_as_the_torch_step(monkeypatch):
    """Gemma 3 with ``dense_kv: bfloat16``: its global layers' rows in float16 keys and bfloat16
    values from the first decode step, its window layers' rings in float32; the fused layers run
    both kinds in one call a step, within float rounding of the float model's torch step over
    the same cache (which reads the same 16-bit rows)."""
    from icecache.cache.window import WindowLayer

    float_model, model = exact_int4("gemma3")
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(0, 97, (90,), generator=g).tolist()
    forced = torch.randint(0, 97, (32,), generator=g).tolist()
    settings = small_settings(dense_until=1024, dense_kv="bfloat16")
    outs, caches, whole = _torch_and_fused("dense", float_model, model, settings, prompt, forced, monkeypatch)
    for cache in caches:
        kinds = {type(layer) is WindowLayer: (layer.keys.dtype, layer.values.dtype) for layer in cache.layers}
        assert kinds == {True: (torch.float32, torch.float32), False: (torch.float16, torch.bfloat16)}
    assert len(whole) == len(forced)  # the int4 model's steps, each in one call
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        err = float((a - b).abs().max())
        assert err <= 1e-5 * float(a.abs().max()), f"step {i}: {err:.2e}"


def test_the_row_lists_follow_the_layers_buffers():
    """``_row_lists``: the same lists while no buffer changes, new ones when a buffer grows or
    takes its 16-bit dtype; float32 and 16-bit buffers side by side (a layer whose keys float16
    cannot hold keeps float32 keys) in the lists of their kinds, each layer's place in ``at``."""
    from icecache.cache.dense import GrowingLayer
    from icecache.fused_step import _row_lists as row_lists

    def _row_lists(layers):
        return row_lists(layers, [(g._k, g._v) for g in layers])

    def layer(scale):
        g = GrowingLayer(torch.bfloat16)
        g.update(torch.randn(1, 2, 30, 8) * scale, torch.randn(1, 2, 30, 8))
        return g

    layers = [layer(1.0), layer(1.0)]
    first = _row_lists(layers)
    (kf, kh), (vf, vh), at = first
    assert (len(kf), len(kh), len(vf), len(vh)) == (2, 0, 2, 0) and at.tolist() == [[0, 0, 0, 0], [0, 1, 0, 1]]
    assert _row_lists(layers) is first
    for g in layers:  # a decode step: 16-bit rows
        g.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    half = _row_lists(layers)
    (kf, kh), (vf, vh), at = half
    assert half is not first and (len(kf), len(vf)) == (0, 0) and at.tolist() == [[1, 0, 1, 0], [1, 1, 1, 1]]
    assert kh[1].dtype.name == "int16" and vh[1].dtype.name == "uint16"
    assert np.shares_memory(kh[1], layers[1]._k.numpy().view(np.int16))  # the buffers themselves
    layers[0]._reserve(layers[0]._k.shape[2] + 1, layers[0]._k, layers[0]._v)  # a buffer grows
    grown = _row_lists(layers)
    assert grown is not half and grown[0][1][0].shape[1] == layers[0]._k.shape[2]
    mixed = [layer(1.0), layer(1e4), layer(1.0)]
    mixed[2].decode_dtype = None  # (float rows throughout, as a window layer's ring)
    for g in mixed:
        g.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    assert [(g._k.dtype, g._v.dtype) for g in mixed] == [(torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                         (torch.float32, torch.float32)]
    (kf, kh), (vf, vh), at = _row_lists(mixed)
    assert at.tolist() == [[1, 0, 1, 0], [0, 0, 1, 1], [0, 1, 0, 0]] and (len(kf), len(kh), len(vf), len(vh)) == (2, 1, 1, 2)


def test_decode_inputs_reach_the_embedded_models_fused_layers():
    """``decode_inputs`` as loaded: ``float`` and ``int16`` as named, ``auto`` int16 where numba
    compiles for AVX2; the fused layers of the step take it."""
    from icecache.config import resolve_settings
    from icecache.int16_inputs import avx2
    from icecache.models import load_model

    for choice, rounded in (("float", False), ("int16", True), ("auto", avx2())):
        model = load_model(None, resolve_settings("cpu", decode_inputs=choice)).model
        fused = FastStep(model)._fused_layers(cache=object())
        assert fused is not None and all(layer[-1] is rounded for layer in fused.layers), choice
