"""The fast decode step (icecache/fast_step.py) against transformers' forward: the same logits,
bit for bit, and the same cache for every method, on each supported architecture and on the
embedded model in float32 and int4."""

from __future__ import annotations

import pytest
import torch

from icecache.config import resolve_settings
from icecache.fast_step import FastStep, fast_step_for, why_not
from icecache.methods import make_cache, names, prepare_model
from tests.test_ice_cache import tiny_model


def small_settings(**changes):
    base = dict(page_size=4, budget=16, sink_pages=1, window_pages=2, dense_layers=1, chunk_size=64,
                rest_estimate=True, prefill="full", pipeline=False, dense_kv="model")
    base.update(changes)
    return resolve_settings("cpu").replace(**base)


def decode_both(model, method: str, settings, prompt: list[int], forced: list[int]):
    """Two caches of ``method``, the same prompt prefilled into each by the model's forward;
    then ``forced`` one token at a time, through the model's forward into the first and through
    :class:`FastStep` into the second. Returns both lists of logits."""
    total = len(prompt) + len(forced) + 1
    prepare_model(method, model, settings, total)
    caches = [make_cache(method, model, settings, total) for _ in range(2)]
    fast = FastStep(model)
    outs: list[list[torch.Tensor]] = [[], []]
    with torch.inference_mode():
        for cache in caches:
            for lo in range(0, len(prompt), settings.chunk_size):
                model(input_ids=torch.tensor([prompt[lo:lo + settings.chunk_size]]), past_key_values=cache,
                      use_cache=True, logits_to_keep=1)
        for t in forced:
            r = model(input_ids=torch.tensor([[t]]), past_key_values=caches[0], use_cache=True, logits_to_keep=1)
            outs[0].append(r.logits[0, -1].clone())
            outs[1].append(fast.step(t, caches[1]).clone())
    return outs


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mistral-window"])
def test_every_method_decodes_as_the_model_forward(arch):
    """Gemma 2 and 3 (window layers shorter than the prompt, sandwich norms, capped scores and
    logits, a RoPE per layer kind) and a Mistral with a sliding window on every layer too. Models
    with window layers: the forward hands a window layer's attention a mask (every key of the
    window visible) where the step hands none, which takes some methods through another kernel
    for the same sum: equal within float rounding, not bit for bit."""
    model = tiny_model(arch.removesuffix("-window"))
    if arch == "mistral-window":
        model.config.sliding_window = 24
    if arch == "gemma2":  # caps that move the logits (the config's would not be reached)
        from tests.test_architectures import capped_gemma2

        model = capped_gemma2()
        model.config.final_logit_softcapping = 0.5
    assert why_not(model) is None
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (150,), generator=g).tolist()
    forced = torch.randint(0, 97, (12,), generator=g).tolist()
    settings = small_settings()
    for method in names():
        ref, got = decode_both(model, method, settings, prompt, forced)
        for step, (a, b) in enumerate(zip(ref, got, strict=True)):
            err = float((a - b).abs().max())
            ok = torch.equal(a, b) if arch in ("llama", "mistral", "qwen2", "qwen3") else err <= 1e-5
            assert ok, f"{arch} {method} step {step}: max |logit difference| {err:.2e}"


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_the_embedded_model_decodes_as_its_forward(loaded, weights):
    """The real weights, ice with the cpu profile's pages and the estimate, and full. int4's
    bfloat16 activations turn any last-bit difference into logit differences of 0.1."""
    from icecache.models import load_model

    model = loaded.model if weights == "float" else load_model(None, resolve_settings("cpu", weights=weights)).model
    assert why_not(model) is None
    assert (FastStep(model).int4 is not None) == (weights == "int4")  # int4: the joined products
    ids = loaded.tokenizer(" ".join(f"Ship {i} docked at pier {i * 7 % 40} before noon." for i in range(40)))["input_ids"]
    forced = loaded.tokenizer(" The ship that docked at pier 14 was ship 2, then more ships came.")["input_ids"]
    settings = resolve_settings("cpu", weights=weights).replace(budget=64, chunk_size=256)
    from icecache.fused_step import unfused

    for method in ("ice", "full"):
        with unfused():  # the torch step (the fused layers: tests/test_fused_step.py)
            ref, got = decode_both(model, method, settings, ids, forced)
        for step, (a, b) in enumerate(zip(ref, got, strict=True)):
            err = float((a - b).abs().max())
            assert torch.equal(a, b), f"{weights} {method} step {step}: max |logit difference| {err:.2e}"


def joinable_model(arch: str):
    """A tiny model whose q/k/v and gate/up rows come in whole blocks of the int4 packing (64)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_joined_int4_products_decode_as_the_modules(arch):
    """int4 weights: a layer's q/k/v and gate/up products joined into one kernel call each
    (qwen2: with the projections' biases) give the forward's logits bit for bit; a layer whose
    modules were replaced after the step was made takes the modules' own calls."""
    from icecache.fast_step import int4_layers
    from icecache.weights import Int4Linear, prompt_products, quantize_model

    model = joinable_model(arch)
    quantize_model(model, "int4")
    with prompt_products():  # where a step is first made during a sparse prefill's prompt steps
        joined = int4_layers(model)
    assert joined is not None and all(j is not None for j in joined)
    a = model.model.layers[0].self_attn
    assert a.k_proj.kernel_weight.data_ptr() == joined[0].qkv[0][a.q_proj.out_features:].data_ptr()  # a view
    assert (joined[0].qkv[2] is not None) == (arch == "qwen2")
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 97, (120,), generator=g).tolist()
    forced = torch.randint(0, 97, (8,), generator=g).tolist()
    for method in ("ice", "full"):
        ref, got = decode_both(model, method, small_settings(), prompt, forced)
        for step, (x, y) in enumerate(zip(ref, got, strict=True)):
            assert torch.equal(x, y), f"{arch} {method} step {step}: {float((x - y).abs().max()):.2e}"
    fast = FastStep(model)
    layer = model.model.layers[1]
    layer.mlp.up_proj = Int4Linear(torch.nn.Linear(64, 128, bias=False))  # swapped after the step was made
    assert not fast.int4[1].current(layer) and fast.int4[0].current(model.model.layers[0])
    ref, got = decode_both(model, "full", small_settings(), prompt, forced)
    assert all(torch.equal(x, y) for x, y in zip(ref, got, strict=True))


def test_int4_products_not_joined_where_the_packing_forbids():
    """K/V rows of 32 (not whole blocks of 64): no layer joins, and decoding is the forward's;
    per-head norms (qwen3): the modules' calls."""
    from icecache.fast_step import int4_layers
    from icecache.weights import quantize_model

    model = tiny_model("llama")
    quantize_model(model, "int4")
    assert int4_layers(model) == [None] * model.config.num_hidden_layers
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 97, (100,), generator=g).tolist()
    forced = torch.randint(0, 97, (6,), generator=g).tolist()
    ref, got = decode_both(model, "ice", small_settings(), prompt, forced)
    assert all(torch.equal(x, y) for x, y in zip(ref, got, strict=True))
    qwen3 = tiny_model("qwen3")
    quantize_model(qwen3, "int4")
    assert int4_layers(qwen3) is None


def test_models_it_cannot_run_fall_back():
    fused = tiny_model("phi3")  # one fused qkv projection
    assert "phi3" in why_not(fused)
    half = tiny_model("llama").to(torch.bfloat16)
    assert "bfloat16" in why_not(half)
    assert fast_step_for(half) is None
    with pytest.raises(ValueError, match="no fast decode step"):
        FastStep(half)
    plain = tiny_model("llama")
    assert fast_step_for(plain) is fast_step_for(plain)  # made once per model


def test_session_uses_it_against_the_forward(loaded, monkeypatch):
    """A session's decode steps take the fast step; with it out of reach (the reference:
    transformers' forward) a session picks the same tokens."""
    from icecache import generation
    from icecache.generation import Session

    ids = loaded.tokenizer("The harbor office opened at dawn. The first ship was the Blue Gull.")["input_ids"]
    outs = []
    for flag in (True, False):
        if not flag:
            monkeypatch.setattr(generation, "fast_step_for", lambda _model: None)
        s = Session(loaded, resolve_settings("cpu"), "ice")
        called = []
        fast = fast_step_for(loaded.model)
        original = fast.step
        fast.step = lambda *a, _c=called, _o=original: (_c.append(1), _o(*a))[1]
        try:
            with torch.inference_mode():
                out, _stats = s.generate(ids, 8)
        finally:
            fast.step = original
        assert bool(called) == flag
        outs.append(out)
    assert outs[0] == outs[1]
