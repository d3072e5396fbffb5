"""The in-place growing dense layer against transformers' concatenating one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.cache import DenseCache, GrowingLayer
from icecache.methods import make_cache, prepare_model
from tests.test_ice_cache import full_cache, run_steps, tiny_model


@pytest.mark.parametrize("H,G,dtype", [(3, 3, torch.float32), (1, 4, torch.float32), (2, 1, torch.bfloat16)])
def test_dense_decode_matches_the_reference(H, G, dtype):
    from icecache.cache.dense import dense_decode
    from icecache.cache.paged import paged_decode_reference

    torch.manual_seed(H * 10 + G)
    q = torch.randn(1, H * G, 1, 16).to(dtype)
    k = (3 * torch.randn(1, H, 777, 16)).to(dtype)
    v = torch.randn(1, H, 777, 16).to(dtype)
    got = dense_decode(q, k, v, 0.25)
    ref = paged_decode_reference(q[0, :, 0].view(H, G, 16), k[0], v[0], torch.ones(H, 777, dtype=torch.bool), 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.view(H, G, 16).float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("G", [1, 3, 4, 6, 7])
@pytest.mark.parametrize("T", [1, 300, 1500])
@pytest.mark.parametrize("half", [False, True])
def test_the_fused_dense_decode_is_the_reference(G, T, half):
    """numba's whole decode step (scores, softmax in blocks of rows joined at the end, values)
    over the first T rows of larger buffers against dense_decode_reference, for every G (the
    scores take the group four queries a pass, three where three are left) and with one, several or a partial block of
    rows (DECODE_ROWS); ``half``: the keys as float16 bits and the values as bfloat16 bits (a
    dense layer's decode dtypes), against the reference over the same rounded rows in float32."""
    from icecache.cache import dense
    from icecache.cache.score_kernels import DECODE_ROWS, dense_decode_fused

    assert 1500 > 2 * DECODE_ROWS and 1500 % DECODE_ROWS
    torch.manual_seed(G * T)
    H, d = 2, 24
    q = torch.randn(1, H * G, 1, d)
    kb, vb = 2 * torch.randn(H, T + 77, d), torch.randn(H, T + 77, d)
    if half:
        kb, vb = kb.half(), vb.bfloat16()
    ref = dense.dense_decode_reference(q, kb[None, :, :T].float(), vb[None, :, :T].float(), 0.2)
    out = np.full((H, G, d), np.nan, np.float32)
    qn = q[0, :, 0].reshape(H, G, d).numpy()
    k, v = dense.kernel_rows(kb), dense.kernel_rows(vb)
    assert (k.dtype, v.dtype) == ((np.int16, np.uint16) if half else (np.float32, np.float32))
    dense_decode_fused(qn, k, v, T, np.float32(0.2), np.float32(0), qn, np.zeros((H, 0, d), np.float32), 0, out)
    torch.testing.assert_close(torch.from_numpy(out).reshape(1, 1, H * G, d), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 300, 5000])
def test_dense_decode_takes_the_kernel_on_a_growing_buffer(T, monkeypatch):
    """dense_decode on the CPU in float32 takes the fused numba step on a view of the first T
    rows of a larger buffer; a layout it cannot read in place (rows not contiguous) takes the
    products (dense_decode_reference); both equal the reference."""
    from icecache.cache import dense, score_kernels

    torch.manual_seed(T)
    q = torch.randn(1, 6, 1, 32)
    kb, vb = 2 * torch.randn(1, 3, T + 77, 32), torch.randn(1, 3, T + 77, 32)
    k, v = kb[:, :, :T], vb[:, :, :T]
    ref = dense.dense_decode_reference(q, k, v, 0.2)
    called = []
    real = score_kernels.dense_decode_fused
    monkeypatch.setattr(score_kernels, "dense_decode_fused", lambda *a: called.append(1) or real(*a))
    got = dense.dense_decode(q, k, v, 0.2)
    assert called == [1]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    got2 = dense.dense_decode(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 0.2)
    torch.testing.assert_close(got2, ref, atol=1e-5, rtol=1e-5)
    assert called == [1]


@pytest.mark.parametrize("arch,kv_heads", [("llama", 2), ("qwen3", 2), ("qwen2", 1)])
def test_dense_cache_decodes_like_dynamic_cache(arch, kv_heads, monkeypatch):
    from icecache.cache import dense

    calls = []
    real = dense.dense_decode
    monkeypatch.setattr(dense, "dense_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model(arch, kv_heads)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 97, 600).tolist()  # 2 chunks of 300: the second grows the buffer
    forced = rng.integers(0, 97, 20).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    prepare_model("dense", model)
    cache = DenseCache(model.config.num_hidden_layers)
    got = run_steps(model, cache, prompt, forced)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 620
    assert len(calls) == 20 * model.config.num_hidden_layers  # every decode step took the fast path
    layer = cache.layers[0]
    assert layer.keys.shape[2] == 620 and layer._k.shape[2] == 600 + 256
    assert cache.device_kv_bytes() == sum(2 * lay._k.numel() * 4 for lay in cache.layers)


def test_growing_layer_grows_in_place_and_crops():
    layer = GrowingLayer()
    k = torch.randn(1, 2, 200, 8)
    v = torch.randn(1, 2, 200, 8)
    layer.update(k, v)
    buf = layer._k
    assert buf.shape[2] == 200 + 256
    for i in range(256):  # fills the buffer without a new one
        layer.update(torch.full((1, 2, 1, 8), float(i)), torch.full((1, 2, 1, 8), -float(i)))
    assert layer._k is buf and layer.get_seq_length() == 456
    layer.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))  # one more row: grows
    assert layer._k is not buf and layer._k.shape[2] == 457 + 256
    torch.testing.assert_close(layer.keys[:, :, :200], k)
    assert float(layer.keys[0, 1, 455, 0]) == 255.0 and float(layer.values[0, 0, 455, 3]) == -255.0
    layer.crop(-7)
    assert layer.get_seq_length() == 450 and layer.keys.shape[2] == 450
    with pytest.raises(ValueError):
        layer.crop(3)


def test_make_cache_dense_method(cpu_settings, loaded):
    cache = make_cache("dense", loaded.model, cpu_settings)
    assert isinstance(cache, DenseCache)
    assert len(cache.layers) == loaded.model.config.num_hidden_layers
