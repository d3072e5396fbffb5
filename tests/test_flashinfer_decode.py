"""FlashInfer's decode path for the resident rows (icecache/cache/flashinfer_decode.py).

On the CPU: the page lists the kernel is given, read back in plain torch, against the reference
attention (masks with holes, partly filled heads, one row); the setting's checks. On a GPU with
flashinfer installed (``pytest -m gpu``): the kernel against the same reference, and ice decoding
through it teacher-forced against ice through torch's attention."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from icecache.cache.backend import TorchBackend
from icecache.cache.flashinfer_decode import attend_lists, page_lists, usable
from icecache.cache.paged import paged_decode_reference
from icecache.config import Settings, validate
from icecache.errors import ProfileError, UsageError

HAS_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def rows(H: int, G: int, L: int, d: int, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((H, G, d), (H, L, d), (H, L, d)))
    valid = np.random.default_rng(seed).random((H, L)) < 0.6
    valid[:, 0] = True  # every head has a row (the sink)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), valid


def test_page_lists_name_each_heads_valid_rows_in_order():
    valid = np.array([[True, False, True, True], [False, False, False, True], [True, True, True, True]])
    indptr, indices = page_lists(valid)
    assert indptr.dtype == indices.dtype == np.int32
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [0, 2, 3, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("H,G,L,d", [(3, 3, 57, 64), (8, 4, 600, 128), (1, 1, 1, 8)])
def test_the_lists_attend_as_the_reference(H, G, L, d):
    q, k, v, valid = rows(H, G, L, d, seed=H + L)
    indptr, indices = page_lists(valid)
    got = attend_lists(q, k, v, indptr, indices, d**-0.5)
    want = paged_decode_reference(q, k, v, torch.from_numpy(valid), d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a list that lost a row would not: drop each head's last valid row
    valid[np.arange(H), valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)] = False
    if valid.any(axis=1).all():
        short = paged_decode_reference(q, k, v, torch.from_numpy(valid), d**-0.5)
        assert not torch.allclose(got, short, atol=1e-5)


def test_the_setting_is_checked():
    with pytest.raises(ProfileError, match="attention_backend"):
        validate(Settings(attention_backend="flashinfer"), "test")  # device: cpu
    with pytest.raises(ProfileError, match="attention_backend"):
        validate(Settings(attention_backend="triton"), "test")
    with pytest.raises(UsageError, match="flashinfer"):
        TorchBackend("cpu", "flashinfer")
    be = TorchBackend("cpu", "auto")  # the CPU keeps torch's attention
    q, k, v, valid = rows(2, 2, 16, 8, seed=1)
    assert not be.flashinfer and be.decode_attention(0, q, k, v, valid, 0.3) is None
    assert not usable(q, k, None)  # float32 on the CPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs a CUDA GPU and flashinfer")
@pytest.mark.parametrize("H,G,L,d", [(8, 4, 600, 128), (2, 4, 37, 128), (1, 1, 5, 128)])
def test_flashinfer_kernel_matches_the_reference(H, G, L, d, dtype=torch.bfloat16):
    be = TorchBackend("cuda", "flashinfer")
    for step in range(3):  # a layer plans again at each step, with another mask
        q, k, v, valid = rows(H, G, L, d, seed=10 * step + d, dtype=dtype, device="cuda")
        got = be.decode_attention(0, q, k, v, valid, d**-0.5)
        assert got is not None and got.shape == (H, G, d)
        want = paged_decode_reference(q, k, v, torch.from_numpy(valid).cuda(), d**-0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs a CUDA GPU and flashinfer")
def test_ice_through_flashinfer_agrees_with_torch_attention(monkeypatch):
    """ice decoding in bfloat16 on the GPU: the tokens torch's attention chooses, fed to a run
    whose steps go through FlashInfer; at least 99% of the steps choose the same next token."""
    import transformers as tf

    from icecache.cache import flashinfer_decode
    from tests.test_gpu import STEPS, run_forced
    from tests.test_pinned import SETTINGS

    # the 8B shape's heads (four query heads of 128 a KV head), three layers
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=512, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=4096)
    model = tf.LlamaForCausalLM(cfg).eval().cuda().to(torch.bfloat16)
    base = SETTINGS.replace(device="cuda", dtype="bfloat16")
    calls = []
    kernel = flashinfer_decode.FlashInferDecode.__call__
    tokens, want, _ = run_forced(model, "ice", base.replace(attention_backend="torch"), None)
    monkeypatch.setattr(flashinfer_decode.FlashInferDecode, "__call__",
                        lambda self, *a: calls.append(1) or kernel(self, *a))
    _, got, _ = run_forced(model, "ice", base.replace(attention_backend="flashinfer"), tokens)
    assert len(calls) >= STEPS  # the steps went through the kernel (not a fallback)
    same = sum(int(torch.argmax(a)) == int(torch.argmax(b)) for a, b in zip(want, got, strict=True))
    assert same >= 0.99 * (STEPS + 1)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=5e-2, rtol=5e-2)
