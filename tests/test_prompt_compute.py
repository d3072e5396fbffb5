"""``prompt_compute``: the prompt's int4-layer products and chunk attention in bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.mark.parametrize("C,P,G", [(300, 0, 3), (300, 517, 3), (128, 1000, 1), (5, 40, 3)])
def test_16_bit_prompt_attention_equals_the_prefix_causal_reference(C, P, G):
    """Against SDPA with the prefix-causal mask over the same rows rounded to bfloat16 (the
    query's scaling rounded with it), and within bfloat16's rounding of the float rows."""
    from icecache.cache.chunked import prefix_causal, prefix_causal_half, prefix_causal_reference
    from icecache.weights import prompt_products

    g = torch.Generator().manual_seed(C + P)
    H, d = 2, 32
    q = torch.randn(1, H * G, C, d, generator=g) * 2
    k = torch.randn(1, H, P + C, d, generator=g)
    v = torch.randn(1, H, P + C, d, generator=g)
    scale = d**-0.5
    got = prefix_causal_half(q, k, v, scale, torch.bfloat16)
    assert got.dtype == torch.float32 and got.shape == (1, H * G, C, d)
    bf = torch.bfloat16
    rounded = prefix_causal_reference((q * scale).to(bf).float(), k.to(bf).float(), v.to(bf).float(), 1.0)
    exact = prefix_causal_reference(q, k, v, scale)
    # the probabilities meet the values in bfloat16: about 0.4% of each term
    assert torch.allclose(got, rounded, atol=2e-2, rtol=2e-2), (got - rounded).abs().max()
    assert torch.allclose(got, exact, atol=5e-2, rtol=5e-2), (got - exact).abs().max()
    # the dispatch: inside prompt_products(bfloat16) only
    assert torch.equal(prefix_causal(q, k, v, scale), prefix_causal(q, k, v, scale))
    assert torch.allclose(prefix_causal(q, k, v, scale), exact, atol=1e-5)
    with prompt_products(torch.bfloat16):
        assert torch.equal(prefix_causal(q, k, v, scale), got)
    with prompt_products():
        assert torch.allclose(prefix_causal(q, k, v, scale), exact, atol=1e-5)


def test_int4_layers_take_bfloat16_products_inside_a_16_bit_prompt_only():
    from icecache import weights as W

    torch.manual_seed(0)
    lin = nn.Linear(96, 64, bias=True)
    mod = W.Int4Linear(lin)
    x = torch.randn(1, 40, 96)
    with W.prompt_products():
        floats = mod(x)
    with W.prompt_products(torch.bfloat16):
        assert W.prompt_half() == torch.bfloat16
        halves = mod(x)
        one = mod(x[:, :1])  # one row (a sparse prefill's tail step): the float product
    assert W.prompt_half() is None
    ref = (x.to(torch.bfloat16).double() @ mod.widened.to(torch.bfloat16).double().T
           + lin.bias.detach().to(torch.bfloat16).double())
    assert halves.dtype == torch.float32 and not torch.equal(halves, floats)
    assert torch.allclose(halves.double(), ref, atol=2e-2, rtol=1e-2)
    assert torch.allclose(halves, floats, atol=5e-2, rtol=2e-2)
    assert torch.allclose(one, floats[:, :1], atol=1e-5, rtol=1e-5)  # (a float product's own rounding)
    with W.prompt_products(torch.bfloat16):  # the 16-bit copy of the weights is made once
        mod(x)
    assert list(mod._half_weights) == [torch.bfloat16]


def test_the_prompt_compute_setting_and_the_saved_prefixes_it_names(monkeypatch, loaded, tmp_path):
    from icecache.cache import dense
    from icecache.config import Settings, validate
    from icecache.doc_cache import DocCache
    from icecache.errors import ProfileError
    from icecache.methods import prompt_half

    s = Settings(prompt_compute="model")
    assert prompt_half(s) is None and prompt_half(s.replace(prompt_compute="bfloat16")) == torch.bfloat16
    monkeypatch.setattr(dense, "native_bf16", lambda: True)
    assert prompt_half(s.replace(prompt_compute="auto")) == torch.bfloat16
    assert prompt_half(s.replace(prompt_compute="auto"), "cuda") is None
    with pytest.raises(ProfileError, match="prompt_compute"):
        validate(s.replace(prompt_compute="half"), "test")
    # a 16-bit prompt's keys are not the float prompt's: the saved prefixes are named apart
    ident = {pc: DocCache(tmp_path, loaded.model, s.replace(prompt_compute=pc))._ident_hash
             for pc in ("model", "bfloat16", "auto")}
    assert ident["bfloat16"] == ident["auto"] != ident["model"]
    monkeypatch.setattr(dense, "native_bf16", lambda: False)
    assert DocCache(tmp_path, loaded.model, s.replace(prompt_compute="auto"))._ident_hash == ident["model"]


def test_a_16_bit_prompt_gives_the_float_prompts_next_token(loaded, cpu_settings):
    """The embedded model (float weights here: the attention's products in bfloat16): the
    logits after the prompt stay close to the float prompt's, with the same greedy token."""
    from icecache.generation import Session

    text = " ".join(f"Pier {i}: the ferry left at {i % 12 + 1} o'clock with {i * 3 % 50} crates." for i in range(60))
    ids = loaded.tokenizer(text)["input_ids"][:700]
    settings = cpu_settings.replace(chunk_size=256, doc_cache="off")
    with torch.inference_mode():
        a, _ = Session(loaded, settings.replace(prompt_compute="model"), "dense").prefill(ids)
        b, _ = Session(loaded, settings.replace(prompt_compute="bfloat16"), "dense").prefill(ids)
    assert int(a.argmax()) == int(b.argmax())
    assert 0 < (a - b).abs().max() < 0.05 * a.abs().max()
