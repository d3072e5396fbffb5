"""Quantized linear weights (icecache.weights) against their float reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from icecache import weights as W
from icecache.config import resolve_settings
from icecache.errors import ProfileError


def _linear(inp: int, out: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(inp, out, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.2, 3.0, out)[:, None])  # channels of different ranges
    return lin


def test_rounding_error_is_at_most_half_a_step_per_channel():
    lin = _linear(96, 40, False)
    q, scale = W.quantize_rows(lin.weight)
    assert q.dtype == torch.int8 and scale.shape == (40,)
    err = (W.dequantized(q, scale) - lin.weight.detach()).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    # the largest weight of every channel is exact (it sets the scale)
    assert torch.allclose(W.dequantized(q, scale).abs().amax(1), lin.weight.detach().abs().amax(1))


def test_a_zero_channel_stays_zero():
    lin = _linear(32, 8, False)
    with torch.no_grad():
        lin.weight[3] = 0
    q, scale = W.quantize_rows(lin.weight)
    assert bool((W.dequantized(q, scale)[3] == 0).all())


@pytest.mark.parametrize("rows", [1, 3, W.ROWS_INT8_KERNEL, W.ROWS_INT8_KERNEL + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_the_dequantized_product(rows, bias, monkeypatch):
    lin = _linear(128, 72, bias, seed=rows)
    monkeypatch.setattr(W, "WIDEN_BLOCK", 32)  # several blocks in the many-row product
    mod = W.Int8Linear(lin)
    x = torch.randn(2, rows, 128)
    # the product runs in bfloat16 (W.COMPUTE) with float32 sums: the reference rounds the input
    # the same way and sums in float64; the tolerance is a few bfloat16 steps of the output
    xr = x.to(W.COMPUTE).double()
    ref = xr @ W.dequantized(mod.qweight, mod.scale).double().T + (lin.bias.detach().double() if bias else 0)
    got = mod(x)
    assert got.shape == (2, rows, 72) and got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, atol=2e-2, rtol=1e-2)
    # and close to the float layer it replaced (quantization error only)
    full = lin(x).detach()
    assert (got - full).abs().max() < 0.05 * full.abs().max()


def test_quantize_model_replaces_every_linear_and_keeps_the_output():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Sequential(nn.Linear(64, 32), nn.ReLU()),
                          nn.Linear(32, 10, bias=False))
    x = torch.randn(5, 64)
    before = model(x).detach()
    assert W.quantize_model(model, "int8") == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    after = model(x)
    assert torch.allclose(after, before, atol=0.05 * before.abs().max().item())
    assert W.quantize_model(nn.Linear(4, 4), "float") == 0
    with pytest.raises(ValueError, match="unknown weight format"):
        W.quantize_model(model, "int3")


def test_weights_setting_is_checked():
    assert resolve_settings("cpu", weights="int8").weights == "int8"
    with pytest.raises(ProfileError, match="--weights.*must be one of float, int8"):
        resolve_settings("cpu", weights="fp4")
    with pytest.raises(ProfileError, match="CPU only"):
        resolve_settings("h100-80gb", weights="int8")


def test_the_embedded_model_with_int8_weights_agrees_with_float(loaded, cpu_settings):
    """Teacher-forced over a real prompt: the int8 model's next-token choices agree with the
    float model's at most positions (the fidelity target is checked by `icecache eval`)."""
    import copy

    tok = loaded.tokenizer
    ids = tok("The history of the printing press begins in the fifteenth century, when movable type "
              "made books cheaper and faster to produce. Within fifty years, presses operated in "
              "more than two hundred cities across Europe, and", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = loaded.model(ids).logits[0]
        q = copy.deepcopy(loaded.model)
        assert W.quantize_model(q, "int8") > 0
        got = q(ids).logits[0]
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
