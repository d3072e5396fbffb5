"""``dense_kv``: dense layers decode from float16 keys and bfloat16 values (the prompt computed in float)."""

from __future__ import annotations

import pytest
import torch


def _filled(T: int, H: int = 3, d: int = 16, seed: int = 0):
    from icecache.cache.dense import GrowingLayer

    g = torch.Generator().manual_seed(seed)
    layer = GrowingLayer(torch.bfloat16)
    k = torch.randn(1, H, T - 1, d, generator=g)
    v = torch.randn(1, H, T - 1, d, generator=g)
    layer.update(k, v)  # a prompt chunk
    k1, v1 = torch.randn(1, H, 1, d, generator=g), torch.randn(1, H, 1, d, generator=g)
    keys, values = layer.update(k1, v1)  # the first decode step converts
    return layer, torch.cat([k, k1], 2), torch.cat([v, v1], 2), keys, values


def test_a_growing_layer_takes_the_decode_dtype_at_its_first_decode_step():
    from icecache.cache.dense import GrowingLayer

    layer = GrowingLayer(torch.bfloat16)
    k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    keys, values = layer.update(k, v)
    assert values.dtype == torch.float32 and torch.equal(values, v)  # the prompt stays exact
    more = torch.randn(1, 2, 30, 8)
    keys, values = layer.update(more, more)  # so does a second prompt chunk
    assert values.dtype == torch.float32 and values.shape[2] == 70
    k, v = torch.cat([k, more], 2), torch.cat([v, more], 2)
    step = torch.randn(1, 2, 2, 8)
    layer.update(step[:, :, :1], step[:, :, :1])  # the first decode step converts (however few rows)
    keys, values = layer.update(step[:, :, 1:], step[:, :, 1:])
    assert keys.dtype == torch.float16 and values.dtype == torch.bfloat16 and values.shape[2] == 72
    assert torch.equal(keys[:, :, :70], k.half()) and torch.equal(keys[:, :, 70:], step.half())
    assert torch.equal(values[:, :, :70], v.bfloat16()) and torch.equal(values[:, :, 70:], step.bfloat16())
    # a prompt chunk after that (a second question) attends in float: copies of the held rows
    more = torch.randn(1, 2, 300, 8)  # grows the buffer too
    keys, values = layer.update(more, more)
    assert values.dtype == torch.float32 and values.shape[2] == 372
    assert torch.equal(values[:, :, 72:], more.bfloat16().float()) and torch.equal(keys[:, :, 72:], more.half().float())
    assert layer.values.dtype == torch.bfloat16 and layer.keys.dtype == torch.float16
    layer.crop(-300)
    assert layer.get_seq_length() == 72 and layer.values.shape[2] == 72
    assert layer.device_bytes() == 2 * layer._k.numel() * 2  # half of float32's
    # keys that float16 cannot hold stay in the model's dtype
    big = GrowingLayer(torch.bfloat16)
    big.update(k * 1e4, v)
    keys, values = big.update(k[:, :, :1], v[:, :, :1])
    assert keys.dtype == torch.float32 and values.dtype == torch.bfloat16


@pytest.mark.parametrize("T", [300, 256, 1000, 70_001])
@pytest.mark.parametrize("numba", [True, False])
def test_a_16_bit_decode_equals_attention_over_the_rounded_values(T, numba, monkeypatch):
    """Against :func:`paged_decode_reference` in float32 over the same float16 keys and bfloat16
    values (numba's kernel: float32 sums, within float rounding; rows it cannot read in place:
    torch's products, where the probabilities meet the values in bfloat16), and within the
    rounding of the float32 rows themselves."""
    from icecache.cache import dense
    from icecache.cache.paged import paged_decode_reference

    if not numba:
        monkeypatch.setattr(dense, "_rows_buffer", lambda _t: None)
    layer, k, v, keys, values = _filled(T, d=16 if T < 10_000 else 8)
    assert keys.dtype == torch.float16 and values.dtype == torch.bfloat16
    H, d = k.shape[1], k.shape[3]
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, 3 * H, 1, d, generator=g) * 2
    got = dense.dense_decode(query, keys, values, d**-0.5)
    assert got.dtype == torch.float32 and got.shape == (1, 1, 3 * H, d)
    q = query[0, :, 0].reshape(H, 3, d)
    valid = torch.ones(H, T, dtype=torch.bool)
    rounded = paged_decode_reference(q, keys[0].float(), values[0].float(), valid, d**-0.5)
    exact = paged_decode_reference(q, k[0], v[0], valid, d**-0.5)
    got = got.reshape(H, 3, d)
    tol = 1e-5 if numba else 2e-2  # torch: the probabilities in bfloat16 (8 bits), about 0.4% a term
    assert torch.allclose(got, rounded, atol=tol, rtol=tol), (got - rounded).abs().max()
    assert torch.allclose(got, exact, atol=2e-2, rtol=2e-2), (got - exact).abs().max()


def test_the_dense_kv_setting_picks_bfloat16_for_a_float32_model_on_any_cpu(monkeypatch):
    from icecache.cache import dense
    from icecache.config import Settings, validate
    from icecache.errors import ProfileError
    from icecache.methods import dense_kv_dtype

    s = Settings(dense_kv="model")
    assert dense_kv_dtype(s) is None  # "model": the model's dtype
    assert dense_kv_dtype(s.replace(dense_kv="bfloat16")) == torch.bfloat16
    assert dense_kv_dtype(s.replace(dense_kv="bfloat16", dtype="bfloat16")) is None  # already 16 bits
    monkeypatch.setattr(dense, "native_bf16", lambda: True)
    auto = s.replace(dense_kv="auto")
    assert dense_kv_dtype(auto, "cpu") == torch.bfloat16
    assert dense_kv_dtype(auto, "cuda") is None
    assert dense_kv_dtype(auto.replace(dtype="float16"), "cpu") is None
    monkeypatch.setattr(dense, "native_bf16", lambda: False)  # numba widens it: no CPU feature asked
    assert dense_kv_dtype(auto, "cpu") == torch.bfloat16
    with pytest.raises(ProfileError, match="dense_kv"):
        validate(s.replace(dense_kv="int8"), "test")


def test_a_dense_session_decodes_from_bfloat16_close_to_float(loaded, cpu_settings, monkeypatch):
    """The ``dense`` method and an all-dense ice run with ``dense_kv: bfloat16``: the layers turn
    to bfloat16 at the first decode step, the logits stay close to float's,
    and the greedy tokens are float's here."""
    from icecache.generation import Session

    text = " ".join(f"Bay {i}: the crane moved crate {i * 7 % 89} to the north quay." for i in range(30))
    ids = loaded.tokenizer(text)["input_ids"][:260]
    for method, extra in (("dense", {}), ("ice", {"dense_until": 400})):
        settings = cpu_settings.replace(prefill="full", positions="true", **extra)
        ref = Session(loaded, settings.replace(dense_kv="model"), method)
        half = Session(loaded, settings.replace(dense_kv="bfloat16"), method)
        a, _ = ref.generate(ids, 6)
        b, _ = half.generate(ids, 6)
        assert all(layer.values.dtype == torch.float32 for layer in ref.cache.layers)
        assert all(layer.values.dtype == torch.bfloat16 and layer.keys.dtype == torch.float16
                   for layer in half.cache.layers), method
        assert a == b, method
        with torch.inference_mode():
            la, lb = ref.forward([a[-1]]), half.forward([b[-1]])
        assert (la - lb).abs().max() < 0.05 * la.abs().max(), method


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_the_kernels_round_to_16_bits_as_torch_does(half):
    """``narrow`` (a fused layer's new rows into a bfloat16 or float16 buffer): to nearest, ties
    to even, as torch's conversion, over values of every magnitude (float16's subnormals, its
    overflow) and exact ties; ``widen`` gives them back."""
    import numpy as np
    from numba import njit

    from icecache.cache.score_kernels import narrow, widen

    @njit
    def both(x, out, back):
        for i in range(x.shape[0]):
            out[i] = narrow(x[i], out[i])
            back[i] = widen(out[i])

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(np.float32)
    every = torch.arange(0, 0x7BFF, dtype=torch.int32).to(torch.int16).view(half).double()  # every finite >= 0
    ties = ((every[:-1] + every[1:]) / 2).float().numpy()  # halfway between neighbours
    x = np.concatenate([x, ties, -ties, np.float32([0.0, -0.0, 1.0, 65504, 65519, 65520, 3e-8, 3.4e38])])
    bits = np.uint16 if half == torch.bfloat16 else np.int16
    out, back = np.empty(x.shape[0], bits), np.empty(x.shape[0], np.float32)
    both(x, out, back)
    want = torch.from_numpy(x).to(half)
    assert (out == want.view(torch.int16).numpy().view(bits)).all()
    finite = want.isfinite().numpy()  # (float16's infinities read back as 65536, never kept: see GrowingLayer)
    assert (back[finite] == want.float().numpy()[finite]).all()


def test_exp32_is_exp_within_two_units_in_the_last_place():
    """The kernels' vectorizable exp against float64's over its whole range (every 2^-16 or so,
    and near zero, where the softmax's largest weights are), and at its ends: 0 below float32's
    smallest normal, e^88 above 88 (not infinity)."""
    import numpy as np
    from numba import njit

    from icecache.cache.score_kernels import exp32

    @njit
    def each(x, out):
        for i in range(x.shape[0]):
            out[i] = exp32(x[i])

    x = np.concatenate([np.linspace(-87.3, 88.0, 8_000_001), np.linspace(-1e-3, 1e-3, 10_001)]).astype(np.float32)
    out = np.empty_like(x)
    each(x, out)
    want = np.exp(x.astype(np.float64))
    assert (np.abs(out - want) <= 2 * 2.0 ** -24 * want).all()
    ends = np.float32([-1e38, -200.0, -87.34, 88.5, 1e38])
    out = np.empty_like(ends)
    each(ends, out)
    assert (out[:3] == 0).all() and (out[3:] == np.float32(np.exp(np.float32(88.0)))).all()
