"""A prompt chunk's attention without a materialized mask (icecache.cache.chunked) against SDPA
with transformers' mask, and the choice of path."""

from __future__ import annotations

import pytest
import torch

from icecache.cache import chunked
from icecache.cache.chunked import is_prefix_causal, prefix_causal, prefix_causal_reference, sdpa_forward


@pytest.mark.parametrize("heads,kv_heads,C,T", [(9, 3, 64, 64), (9, 3, 48, 200), (4, 4, 33, 97), (6, 1, 16, 500)])
def test_prefix_causal_equals_sdpa_with_the_mask(heads, kv_heads, C, T):
    torch.manual_seed(C + T)
    q = torch.randn(1, heads, C, 64) * 2
    k, v = torch.randn(1, kv_heads, T, 64) * 2, torch.randn(1, kv_heads, T, 64)
    ref = prefix_causal_reference(q, k, v, 0.125)
    out = prefix_causal(q, k, v, 0.125)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    # the chunk's first row sees the prefix and itself only: a change to a later chunk row's key
    # leaves it alone, and moves the rows that see it
    k2 = k.clone()
    k2[:, :, T - 1] += 5
    moved = prefix_causal(q, k2, v, 0.125)
    torch.testing.assert_close(moved[:, :, 0], out[:, :, 0], atol=2e-6, rtol=1e-5)
    assert not torch.allclose(moved[:, :, -1], out[:, :, -1])


def test_a_transposed_query_as_transformers_passes_it():
    torch.manual_seed(0)
    q = torch.randn(1, 40, 9, 64).transpose(1, 2)  # (1, heads, C, d), not contiguous
    k, v = torch.randn(1, 3, 100, 64), torch.randn(1, 3, 100, 64)
    torch.testing.assert_close(prefix_causal(q, k, v, 0.125), prefix_causal_reference(q, k, v, 0.125),
                               atol=2e-6, rtol=1e-5)


class Module:
    is_causal = True
    num_key_value_groups = 3


def run(mask, C, T, **kw):
    torch.manual_seed(1)
    q = torch.randn(1, 9, C, 64)
    k, v = torch.randn(1, 3, T, 64), torch.randn(1, 3, T, 64)
    out, _ = sdpa_forward(Module(), q, k, v, mask, scaling=0.125, **kw)
    ref = prefix_causal_reference(q, k, v, 0.125).transpose(1, 2)
    return out, ref


def test_sdpa_forward_takes_the_maskless_path_only_for_the_prefix_causal_pattern(monkeypatch):
    calls = []
    real = chunked.prefix_causal
    monkeypatch.setattr(chunked, "prefix_causal", lambda *a: calls.append(1) or real(*a))
    C, T = 24, 80
    causal = torch.ones(C, T, dtype=torch.bool).tril(diagonal=T - C)[None, None]
    out, ref = run(causal, C, T)
    assert calls and out.shape == (1, C, 9, 64)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    calls.clear()
    out, ref = run(None, C, C)  # the first chunk: no mask, the chunk is the whole sequence
    assert calls
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    # any other mask goes to transformers' SDPA with it, and its result follows the mask
    padded = causal.clone()
    padded[..., :5] = False
    calls.clear()
    out, ref = run(padded, C, T)
    assert not calls and not torch.allclose(out, ref)
    assert not is_prefix_causal(causal.float(), C, T)
    window = causal & (torch.arange(T)[None, :] > torch.arange(C)[:, None] + (T - C) - 40)  # a sliding window
    assert not is_prefix_causal(window, C, T)
    assert not is_prefix_causal(causal.expand(2, 1, C, T), C, T)  # two sequences
    calls.clear()
    run(causal, C, T, dropout=0.1)
    assert not calls


def test_bfloat16_chunks_as_the_masked_reference():
    """A bfloat16 model's chunks: the merge runs in float32 and returns the input's dtype."""
    torch.manual_seed(3)
    q = torch.randn(1, 9, 40, 64).bfloat16()
    k, v = torch.randn(1, 3, 130, 64).bfloat16(), torch.randn(1, 3, 130, 64).bfloat16()
    out = prefix_causal(q, k, v, 0.125)
    ref = prefix_causal_reference(q.float(), k.float(), v.float(), 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_one_wrong_cell_anywhere_in_the_mask_is_caught():
    C, T = 16, 50
    causal = torch.ones(C, T, dtype=torch.bool).tril(diagonal=T - C)[None, None]
    assert is_prefix_causal(causal.clone(), C, T)
    for i in range(C):
        for j in range(0, T, 7):
            m = causal.clone()
            m[0, 0, i, j] = ~m[0, 0, i, j]
            assert not is_prefix_causal(m, C, T), (i, j)
