"""Quantized linear weights (icecache.weights) against their float reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from icecache import weights as W
from icecache.config import resolve_settings
from icecache.errors import ProfileError
from icecache.head import CheckedHead, head_tables


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


def _forced_agreement(loaded, fmt: str) -> tuple[int, float]:
    """(layers replaced, share of positions where a copy of the model in ``fmt`` picks the float
    model's next token), teacher-forced over a real prompt."""
    import copy

    ids = loaded.tokenizer("The history of the printing press begins in the fifteenth century, when movable "
                           "type made books cheaper and faster to produce. Within fifty years, presses "
                           "operated in more than two hundred cities across Europe, and",
                           return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = loaded.model(ids).logits[0]
        q = copy.deepcopy(loaded.model)
        replaced = W.quantize_model(q, fmt)
        got = q(ids).logits[0]
    return replaced, (ref.argmax(-1) == got.argmax(-1)).float().mean().item()


def test_the_embedded_model_with_int8_weights_agrees_with_float(loaded, cpu_settings):
    """Teacher-forced over a real prompt: the int8 model's next-token choices agree with the
    float model's at most positions (the fidelity target is checked by `icecache eval`)."""
    replaced, agree = _forced_agreement(loaded, "int8")
    assert replaced > 0
    assert agree >= 0.9, agree


# --- int4: 4-bit values in groups of 32 inputs, a step and a minimum per group ---

def _q4_1_like(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4_1 GGUF stores them: d * q + m per block of 32 inputs, q in 0..15, d and m
    float16, every block using q = 0 and q = 15 (its minimum and maximum)."""
    g = torch.Generator().manual_seed(seed)
    blocks = inp // W.GROUP
    q = torch.randint(0, 16, (out, blocks, W.GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out, blocks, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(out, blocks, 1, generator=g) * 0.1).half().float()
    return (q * d + m).reshape(out, inp)


def test_int4_groups_round_to_the_nearest_of_sixteen_levels():
    lin = _linear(128, 48, False)
    q, step, low = W.quantize_groups(lin.weight)
    assert q.shape == (48, 128) and step.shape == low.shape == (48, 128 // W.GROUP)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    err = (W.dequantized_groups(q, step, low) - lin.weight.detach()).abs()
    assert bool((err <= step.repeat_interleave(W.GROUP, dim=1) / 2 + 1e-6).all())
    # a group's smallest and largest weights are kept
    wg = lin.weight.detach().reshape(48, -1, W.GROUP)
    back = W.dequantized_groups(q, step, low).reshape(48, -1, W.GROUP)
    assert torch.allclose(back.amin(-1), wg.amin(-1), atol=1e-6)
    assert torch.allclose(back.amax(-1), wg.amax(-1), atol=1e-6)


def test_int4_finds_q4_1_weights_again_and_keeps_constant_groups():
    w = _q4_1_like(32, 96)
    w[5, :W.GROUP] = 0.25  # a group of equal weights
    q, step, low = W.quantize_groups(w)
    assert torch.allclose(W.dequantized_groups(q, step, low), w, rtol=0, atol=1e-6)
    assert bool((W.dequantized_groups(q, step, low)[5, :W.GROUP] == 0.25).all())


@pytest.mark.parametrize("rows", [1, 2, W.ROWS_INT8_KERNEL, W.ROWS_INT8_KERNEL + 1, 150])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_equals_the_dequantized_product(rows, bias):
    lin = _linear(96, 64, bias, seed=rows)
    mod = W.Int4Linear(lin)
    q, step, low = W.quantize_groups(lin.weight)
    x = torch.randn(2, rows, 96)
    # bfloat16 products with float32 sums: the reference rounds the input the same way and sums
    # in float64; the tolerance is a few bfloat16 steps of the output (the kernel's step/offset
    # table is bfloat16 too)
    kernel = rows <= W.ROWS_INT8_KERNEL
    xr = x.to(W.COMPUTE).double() if kernel else x.double()
    ref = xr @ W.dequantized_groups(q, step, low).double().T
    if bias:
        ref = ref + lin.bias.detach().double()
    got = mod(x)
    assert got.shape == (2, rows, 64) and got.dtype == torch.float32
    if kernel:
        assert torch.allclose(got.double(), ref, atol=3e-2, rtol=1e-2)
    else:  # many rows: the float product of the same values
        assert torch.allclose(got.double(), ref, atol=1e-4, rtol=1e-5)
    full = lin(x).detach()
    assert (got - full).abs().max() < 0.1 * full.abs().max()


def test_int4_refuses_a_shape_its_kernel_cannot_take():
    with pytest.raises(ValueError, match="multiples of 32"):
        W.Int4Linear(nn.Linear(40, 32))
    with pytest.raises(ValueError, match="multiples of 16"):
        W.Int4Linear(nn.Linear(64, 24))


class _TinyLM(nn.Module):
    """A model with an output projection the way transformers' models name it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 40), nn.ReLU(), nn.Linear(40, 64))
        self.lm_head = nn.Linear(64, 48, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, x):
        return self.lm_head(self.body(x))


def test_int4_model_checks_the_lm_head_and_keeps_the_shapes_the_kernel_cannot_take():
    torch.manual_seed(2)
    model = _TinyLM()
    x = torch.randn(3, 64)
    before = model(x).detach()
    head_weight = model.lm_head.weight
    # 64 -> 32 fits; 32 -> 40 has 40 outputs, 40 -> 64 has 40 inputs; the head is checked
    assert W.quantize_model(model, "int4") == 2
    assert isinstance(model.body[0], W.Int4Linear)
    assert all(type(model.body[i]) is nn.Linear for i in (2, 4))
    assert isinstance(model.lm_head, CheckedHead)
    assert model.lm_head.weight.data_ptr() == head_weight.data_ptr()  # the float weight, not a copy
    after = model(x)
    assert torch.allclose(after, before, atol=0.1 * before.abs().max().item())
    # int8 takes every linear layer, the head included
    model8 = _TinyLM()
    assert W.quantize_model(model8, "int8") == 4
    assert isinstance(model8.lm_head, W.Int8Linear)


def _four_bit_groups(model: nn.Module, seed: int = 0) -> None:
    """Give every linear layer but the head weights that are 4-bit groups of 32 (what a Q4_1 GGUF
    holds): ``(q + low) * step`` with q in 0..15 (both ends in every group), an integer ``low``
    per group and a power-of-two step, so that every value and the group's range are exact."""
    head = model.get_output_embeddings()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod is not head and W.int4_fits(mod):
                n, k = mod.weight.shape
                q = torch.randint(0, 16, (n, k // W.GROUP, W.GROUP), generator=g).float()
                q[..., 0], q[..., 1] = 0.0, 15.0
                low = torch.randint(-12, 0, (n, k // W.GROUP, 1), generator=g).float()
                mod.weight.copy_(((q + low) * 2.0 ** -7).reshape(n, k))


def test_auto_weights_take_int4_only_where_it_holds_the_model_exactly():
    torch.manual_seed(3)
    x = torch.randn(2, 64)
    # float weights: int4 would round them, so auto keeps the layers as they are; the LM head is
    # the checked int8 head, whose largest logit is the float head's
    model = _TinyLM()
    before = model(x).detach()
    assert W.exact_int4_layers(model) == {}
    assert W.apply_weights(model, "auto") == "float+int8head"
    assert type(model.body[0]) is nn.Linear and isinstance(model.lm_head, CheckedHead)
    assert torch.equal(model(x).argmax(-1), before.argmax(-1))
    # weights that are 4-bit groups already: auto gives the int4 model, the same as asking for int4
    grouped = _TinyLM()
    _four_bit_groups(grouped)
    one_layer_off = copy.deepcopy(grouped)
    ref = copy.deepcopy(grouped)
    ref_weight_ptr = grouped.body[0].weight.data_ptr()
    float_copy = copy.deepcopy(grouped)
    assert W.apply_weights(grouped, "auto") == "int4"
    assert isinstance(grouped.body[0], W.Int4Linear) and isinstance(grouped.lm_head, CheckedHead)
    assert type(grouped.body[2]) is nn.Linear  # a shape the kernel cannot take stays float
    W.quantize_model(ref, "int4")
    assert torch.equal(grouped(x), ref(x))
    assert grouped.body[0].exact and grouped.body[0].widened.data_ptr() == ref_weight_ptr  # no copy
    many = torch.randn(20, 64)  # a prefill chunk's rows: the float model's own products
    assert torch.equal(grouped(many), float_copy(many))
    # one weight moved off its group's levels: that layer stays float (here the only one int4 takes)
    with torch.no_grad():
        one_layer_off.body[0].weight[3, 5] += 1e-3
    assert W.apply_weights(one_layer_off, "auto") == "float+int8head"
    assert type(one_layer_off.body[0]) is nn.Linear and isinstance(one_layer_off.lm_head, CheckedHead)
    # two such layers, one of them off: int4 where it is exact, float where not
    mixed = _TinyLM()
    mixed.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64))
    _four_bit_groups(mixed)
    with torch.no_grad():
        mixed.body[2].weight[40, 3] += 1e-3  # past the rows the quick test reads
    assert W.apply_weights(mixed, "auto") == "int4+float"
    assert isinstance(mixed.body[0], W.Int4Linear) and type(mixed.body[2]) is nn.Linear
    # off the CPU auto keeps the model's dtype without looking
    other = _TinyLM()
    _four_bit_groups(other)
    assert W.apply_weights(other, "auto", device="cuda") == "float"
    assert type(other.body[0]) is nn.Linear
    # a named format is applied as asked
    assert W.apply_weights(_TinyLM(), "int8") == "int8"


def test_auto_weights_setting_runs_on_every_device():
    assert resolve_settings("cpu", weights="auto").weights == "auto"
    assert resolve_settings("h100-80gb", weights="auto").weights == "auto"
    with pytest.raises(ValueError, match="unknown weight format"):
        W.quantize_model(_TinyLM(), "auto")  # auto is resolved by apply_weights, not here


def test_the_embedded_model_loads_in_int4_with_auto_weights(cpu_settings):
    """The embedded GGUF's layers are 4-bit groups, so auto gives the int4 model."""
    from icecache.models import load_model

    loaded = load_model(None, cpu_settings.replace(weights="auto"))
    assert loaded.weights == "int4"
    assert isinstance(loaded.model.get_output_embeddings(), CheckedHead)
    assert sum(isinstance(m, W.Int4Linear) for m in loaded.model.modules()) == 7 * loaded.model.config.num_hidden_layers


def test_int4_setting_is_checked():
    assert resolve_settings("cpu", weights="int4").weights == "int4"
    with pytest.raises(ProfileError, match="CPU only"):
        resolve_settings("h100-80gb", weights="int4")


def test_the_embedded_models_layers_are_held_exactly_in_int4(loaded):
    """The embedded GGUF is Q4_1: every decoder linear layer is found again by int4 groups."""
    head = loaded.model.get_output_embeddings()
    checked = 0
    for mod in loaded.model.modules():
        if isinstance(mod, nn.Linear) and mod is not head:
            q, step, low = W.quantize_groups(mod.weight)
            assert torch.equal(W.dequantized_groups(q, step, low), mod.weight.detach())
            checked += 1
    assert checked == 7 * loaded.model.config.num_hidden_layers


def test_the_embedded_model_with_int4_weights_agrees_with_float(loaded):
    replaced, agree = _forced_agreement(loaded, "int4")
    assert replaced == 7 * loaded.model.config.num_hidden_layers + 1  # and the head
    assert agree >= 0.95, agree


def test_head_tables_block_by_block_equal_the_whole_matrix():
    torch.manual_seed(4)
    w = torch.randn(1000, 96) * torch.linspace(0.1, 4.0, 1000)[:, None]
    w[17] = 0.0  # a zero row keeps scale 1
    q, scale = W.quantize_rows(w)
    scale_c = scale.to(W.COMPUTE)
    err = (q.float() * scale_c.float()[:, None] - w).abs().amax(1)
    for block in (1000, 333, 64):
        got = head_tables(w, block=block)
        assert torch.equal(got[0], q) and torch.equal(got[1], scale_c)
        assert torch.equal(got[2], err) and torch.equal(got[3], w.abs().amax(1))


@pytest.mark.parametrize("bias", [False, True])
def test_checked_head_gives_the_float_heads_largest_logit(bias):
    """Approximate logits within their bound everywhere, the float logits wherever the maximum
    could be, so the argmax is the float head's, also among near-ties."""
    torch.manual_seed(3)
    lin = nn.Linear(64, 512, bias=bias)
    with torch.no_grad():
        lin.weight[7] = lin.weight[5] + 1e-4  # near-ties between rows 5 and 7
        lin.weight.mul_(torch.linspace(0.5, 2.0, 512)[:, None])
    head = CheckedHead(lin)
    x = torch.randn(2, 3, 64)
    x[0, 0] = lin.weight[5].detach() * 2  # a row whose maximum is row 5 or 7, barely apart
    ref = lin(x).detach()
    got = head(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    approx, mask = head.candidates(x.reshape(-1, 64))
    exact_rows = mask.reshape(2, 3, -1)
    # the candidates hold the float values; the rest are within the bound of theirs
    assert torch.allclose(got[exact_rows], ref[exact_rows], atol=1e-5, rtol=1e-6)
    assert bool(exact_rows.reshape(-1, 512).gather(1, ref.reshape(-1, 512).argmax(-1, keepdim=True)).all())
    assert (got - ref).abs().max() < 0.5
    assert 0 < head.exact_rows < 6 * 512  # not every row recomputed
    # many rows (a prefill's logits) are the float product itself
    many = torch.randn(W.ROWS_INT8_KERNEL + 1, 64)
    assert torch.allclose(head(many), lin(many).detach(), atol=1e-6)


def test_the_embedded_models_checked_head_picks_the_float_heads_tokens(loaded):
    head = loaded.model.get_output_embeddings()
    checked = CheckedHead(head)
    torch.manual_seed(4)
    hidden = torch.randn(40, head.in_features) * 0.5
    with torch.inference_mode():
        ref = head(hidden)
        got = checked(hidden[:, None, :])[:, 0]
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert checked.exact_rows < 40 * head.out_features // 100  # a small share recomputed


def _grouped_tiny_llama():
    """A tiny Llama whose linear layers are 4-bit groups (as a Q4_1 GGUF's), with a float copy."""
    from tests.test_ice_cache import tiny_model

    model = tiny_model("llama")
    _four_bit_groups(model)
    float_model = copy.deepcopy(model)
    assert W.apply_weights(model, "auto") == "int4"
    return float_model, model


@pytest.mark.parametrize("method,prefill", [("full", "full"), ("ice", "sparse")])
def test_a_prompt_computes_as_the_float_model_and_decode_steps_take_the_kernels(method, prefill):
    """Prompt tokens (a short last chunk; a sparse prefill's one-at-a-time last tokens) run the
    float products of the int4 layers' exact values: the cache and the first token's logits are the
    float model's, bit for bit. Decode steps take the four-bit kernels: their logits move."""
    from icecache.generation import Session
    from icecache.models import LoadedModel

    float_model, int4_model = _grouped_tiny_llama()
    settings = resolve_settings("cpu").replace(
        page_size=4, budget=16, sink_pages=1, window_pages=2, dense_layers=1, chunk_size=64,
        prefill=prefill, prefill_queries=4, pipeline=False, answer_spans=0,
        prompt_compute="model")  # (a bfloat16 prompt, tests/test_prompt_compute.py, is not the float model's)
    prompt = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    logits, sessions = [], []
    for model in (float_model, int4_model):
        s = Session(LoadedModel(model=model, tokenizer=None, name="tiny", context_length=4096,
                                load_seconds=0.0), settings, method)
        s.new_tokens = 8
        with torch.inference_mode():
            got, _ = s.prefill(prompt)
        logits.append(got)
        sessions.append(s)
    assert torch.equal(logits[0], logits[1])
    with torch.inference_mode():
        steps = [s.forward([int(logits[0].argmax())]) for s in sessions]
        one_row = int4_model(input_ids=torch.tensor([prompt[:1]])).logits
        with W.prompt_products():
            one_row_float = int4_model(input_ids=torch.tensor([prompt[:1]])).logits
        reference = float_model(input_ids=torch.tensor([prompt[:1]])).logits
    assert not torch.equal(steps[0], steps[1])  # bfloat16 products in the decode step
    assert torch.allclose(steps[0], steps[1], atol=0.05 * steps[0].abs().max().item())
    assert not torch.equal(one_row, reference) and torch.equal(one_row_float, reference)
    assert not W.in_prompt()
