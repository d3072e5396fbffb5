"""Capped attention scores (Gemma 2's ``attn_logit_softcapping``): each of icecache's attentions
with a ``softcap`` against one plain torch reference (scores scaled, capped as ``cap *
tanh(score / cap)``, then masked and biased; softmax in float32), and without one unchanged.
The caps are small enough that they move every result (checked against the uncapped
reference), so a path that ignored its cap would fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.cache.chunked import (
    capped_attention,
    prefix_causal,
    prefix_causal_half,
    prefix_causal_reference,
    sdpa_forward,
    soft_cap,
)
from icecache.cache.dense import dense_decode, dense_decode_reference, windowed_dense
from icecache.cache.paged import (
    paged_chunk_capped,
    paged_chunk_flash,
    paged_chunk_reference,
    paged_chunk_sdpa,
    paged_decode_reference,
    paged_decode_rest,
    paged_decode_rest_reference,
    paged_decode_sdpa,
    paged_decode_weighted,
    paged_decode_weighted_reference,
)
from icecache.cache.positions import attend_regions

CAP = 1.5


def plain(q, k, v, allowed, scaling, cap, bias=None):
    """q (H, G, C, d); k, v (H, L, d); allowed (H, C, L) bool; bias (H, G, L) or None ->
    (H, G, C, d) float32."""
    s = torch.einsum("hgcd,hld->hgcl", q.double(), k.double()) * scaling
    if cap:
        s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias.double()[:, :, None, :]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("hgcl,hld->hgcd", torch.softmax(s, -1), v.double()).float()


def rand(*shape, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * spread


def prefix_allowed(H, C, T):
    return torch.ones(C, T, dtype=torch.bool).tril(diagonal=T - C)[None].expand(H, C, T)


def close(got, want, uncapped=None, atol=2e-5):
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=1e-4)
    if uncapped is not None:  # the cap moved the result: a path ignoring it would fail
        assert float((uncapped - want).abs().max()) > 100 * atol


def test_soft_cap_is_in_place_and_none_leaves_the_scores_alone():
    s = rand(4, 5)
    same = s.clone()
    assert soft_cap(s, None) is s and torch.equal(s, same)
    assert soft_cap(s, 0.0) is s and torch.equal(s, same)
    assert soft_cap(s, CAP) is s
    torch.testing.assert_close(s, CAP * torch.tanh(same / CAP))


@pytest.mark.parametrize("heads,kv_heads,C,T", [(4, 2, 6, 20), (2, 2, 5, 5), (6, 1, 300, 400)])
def test_prefix_causal_caps_like_the_reference(heads, kv_heads, C, T):
    q, k, v = rand(1, heads, C, 8, seed=1), rand(1, kv_heads, T, 8, seed=2), rand(1, kv_heads, T, 8, seed=3, spread=1)
    G = heads // kv_heads
    qq = q[0].view(kv_heads, G, C, 8)
    want = plain(qq, k[0], v[0], prefix_allowed(kv_heads, C, T), 0.3, CAP).reshape(1, heads, C, 8)
    uncapped = plain(qq, k[0], v[0], prefix_allowed(kv_heads, C, T), 0.3, None).reshape(1, heads, C, 8)
    close(prefix_causal(q, k, v, 0.3, CAP), want, uncapped)
    close(prefix_causal_reference(q, k, v, 0.3, CAP), want)
    close(prefix_causal_half(q, k, v, 0.3, torch.bfloat16, softcap=CAP), want, atol=0.15)
    close(prefix_causal(q, k, v, 0.3), uncapped)  # no cap: the flash kernels, as before


def test_sdpa_forward_caps_under_any_mask():
    """transformers' SDPA refuses a cap: the prefix-causal pattern goes to prefix_causal, a
    sliding-window mask (boolean) and an additive one to capped_attention, as does a decode step."""

    class Module:
        is_causal = True
        num_key_value_groups = 2

    H, Hq, C, T = 2, 4, 6, 20
    q, k, v = rand(1, Hq, C, 8, seed=4), rand(1, H, T, 8, seed=5), rand(1, H, T, 8, seed=6, spread=1)
    qq = q[0].view(H, 2, C, 8)
    window = prefix_allowed(H, C, T) & ~torch.ones(C, T, dtype=torch.bool).tril(diagonal=T - C - 5)
    for allowed in (prefix_allowed(H, C, T), window):
        want = plain(qq, k[0], v[0], allowed, 0.3, CAP).reshape(Hq, C, 8).transpose(0, 1)[None]
        for mask in (allowed[:1, None], torch.zeros(1, 1, C, T).masked_fill(~allowed[:1, None], float("-inf"))):
            out, _ = sdpa_forward(Module(), q, k, v, mask, scaling=0.3, softcap=CAP, sliding_window=5)
            close(out, want)
    one = q[:, :, -1:]
    want = plain(one[0].view(H, 2, 1, 8), k[0], v[0], torch.ones(H, 1, T, dtype=torch.bool), 0.3, CAP)
    close(sdpa_forward(Module(), one, k, v, None, scaling=0.3, softcap=CAP)[0], want.reshape(1, Hq, 8)[:, None])
    close(capped_attention(q, k, v, None, 0.3, CAP),
          plain(qq, k[0], v[0], prefix_allowed(H, C, T), 0.3, CAP).reshape(Hq, C, 8).transpose(0, 1)[None])


@pytest.mark.parametrize("T", [50, 4100])  # the fused numba step: one block of rows, several
def test_dense_decode_caps_the_scores(T):
    H, G, d = 2, 3, 16
    q, k, v = rand(1, H * G, 1, d, seed=7), rand(1, H, T, d, seed=8), rand(1, H, T, d, seed=9, spread=1)
    allowed = torch.ones(H, 1, T, dtype=torch.bool)
    want = plain(q[0].view(H, G, 1, d), k[0], v[0], allowed, 0.25, CAP).reshape(1, 1, H * G, d)
    uncapped = plain(q[0].view(H, G, 1, d), k[0], v[0], allowed, 0.25, None).reshape(1, 1, H * G, d)
    close(dense_decode(q, k, v, 0.25, softcap=CAP), want, uncapped)
    close(dense_decode_reference(q, k, v, 0.25, softcap=CAP), want)
    close(dense_decode(q, k, v, 0.25), uncapped)
    # 16-bit keys and values (a growing layer's decode dtype): the rounded rows, capped
    kh, vh = k.to(torch.bfloat16), v.to(torch.bfloat16)
    want16 = plain(q[0].view(H, G, 1, d), kh[0].float(), vh[0].float(), allowed, 0.25, CAP).reshape(1, 1, H * G, d)
    close(dense_decode(q, kh, vh, 0.25, softcap=CAP), want16, atol=3e-2)


def test_windowed_dense_caps_the_sink_and_window_chunk():
    H, G, C, n, sink, window = 2, 2, 5, 40, 4, 10
    q, k, v = rand(1, H * G, C, 8, seed=10), rand(1, H, n, 8, seed=11), rand(1, H, n, 8, seed=12, spread=1)
    w0 = n - C - window
    allowed = prefix_allowed(H, C, n).clone()
    allowed[:, :, sink:w0] = False
    want = plain(q[0].view(H, G, C, 8), k[0], v[0], allowed, 0.3, CAP).reshape(H * G, C, 8).transpose(0, 1)[None]
    close(windowed_dense(q, k, v, sink, window, 0.3, softcap=CAP), want)


def paged_case(seed=13, H=2, G=3, L=30):
    q, k, v = rand(H, G, 16, seed=seed), rand(H, L, 16, seed=seed + 1), rand(H, L, 16, seed=seed + 2, spread=1)
    valid = torch.from_numpy(np.random.default_rng(seed).random((H, L)) < 0.7)
    valid[:, 0] = True
    return q, k, v, valid


def test_paged_decode_caps_plain_weighted_and_rest_estimate_rows():
    q, k, v, valid = paged_case()
    H, G, L = q.shape[0], q.shape[1], k.shape[1]
    allowed = valid[:, None, :]
    want = plain(q[:, :, None], k, v, allowed, 0.25, CAP)[:, :, 0]
    uncapped = plain(q[:, :, None], k, v, allowed, 0.25, None)[:, :, 0]
    close(paged_decode_sdpa(q, k, v, valid, 0.25, CAP), want, uncapped)
    close(paged_decode_reference(q, k, v, valid, 0.25, CAP), want)
    close(paged_decode_sdpa(q, k, v, valid, 0.25), uncapped)
    # MagicPIG's weighted rows: the cap on q.k * scaling, the log-weight added after it
    pool_at, R = 5, 10
    bias = rand(H, G, R, seed=20, spread=1)
    full_bias = torch.zeros(H, G, L)
    full_bias[:, :, pool_at : pool_at + R] = bias
    want = plain(q[:, :, None], k, v, allowed, 0.25, CAP, full_bias)[:, :, 0]
    close(paged_decode_weighted(q, k, v, valid, bias, pool_at, 0.25, CAP), want,
          plain(q[:, :, None], k, v, allowed, 0.25, None, full_bias)[:, :, 0])
    close(paged_decode_weighted_reference(q, k, v, valid, bias, pool_at, 0.25, CAP), want)
    # the rest estimate's rows: capped like real keys, their log-counts added after the cap
    P = 4
    gk, gv = rand(H, 16, P, seed=21), rand(H, P, 16, seed=22, spread=1)
    gb = torch.tensor([[0.0, 1.0, float("-inf"), 2.0], [float("-inf"), 0.5, 0.5, 0.0]])
    keys, values = torch.cat([k, gk.transpose(1, 2)], 1), torch.cat([v, gv], 1)
    rest_bias = torch.cat([torch.zeros(H, L), gb], 1)[:, None].expand(H, G, L + P)
    rest_allowed = torch.cat([valid, torch.ones(H, P, dtype=torch.bool)], 1)[:, None, :]
    want = plain(q[:, :, None], keys, values, rest_allowed, 0.25, CAP, rest_bias)[:, :, 0]
    uncapped = plain(q[:, :, None], keys, values, rest_allowed, 0.25, None, rest_bias)[:, :, 0]
    close(paged_decode_rest(q, k, v, valid, [(gk, gv, gb)], 0.25, CAP), want, uncapped)
    close(paged_decode_rest_reference(q, k, v, valid, [(gk, gv, gb)], 0.25, CAP), want)
    close(paged_decode_rest(q, k, v, valid, [(gk, gv, gb)], 0.25), uncapped)


def test_a_sparse_prefill_chunk_caps_its_scores():
    H, G, C, L, chunk_at = 2, 2, 6, 30, 20
    q = rand(H, G, C, 16, seed=30)
    k, v = rand(H, L, 16, seed=31), rand(H, L, 16, seed=32, spread=1)
    valid = torch.from_numpy(np.random.default_rng(3).random((H, L)) < 0.7)
    valid[:, chunk_at : chunk_at + C] = True
    valid[:, chunk_at + C :] = False
    allowed = valid[:, None, :].expand(H, C, L).clone()
    allowed[:, :, chunk_at : chunk_at + C] &= torch.ones(C, C, dtype=torch.bool).tril()
    want, uncapped = plain(q, k, v, allowed, 0.25, CAP), plain(q, k, v, allowed, 0.25, None)
    for attend in (paged_chunk_reference, paged_chunk_flash, paged_chunk_sdpa):
        close(attend(q, k, v, valid, chunk_at, 0.25, CAP), want, uncapped)
        close(attend(q, k, v, valid, chunk_at, 0.25), uncapped)
    close(paged_chunk_capped(q, k, v, valid, chunk_at, 0.25, CAP, block=4), want)


def test_remapped_regions_cap_every_region():
    q1, q2 = rand(2, 3, 16, seed=40), rand(2, 3, 16, seed=41)
    k, v = rand(2, 12, 16, seed=42), rand(2, 12, 16, seed=43, spread=1)
    out = attend_regions([(q1, k[:, :4], v[:, :4]), (q2, k[:, 4:], v[:, 4:])], None, 0.25, CAP)
    s = torch.cat([torch.einsum("hgd,hld->hgl", q1, k[:, :4]), torch.einsum("hgd,hld->hgl", q2, k[:, 4:])], -1) * 0.25
    want = torch.einsum("hgl,hld->hgd", torch.softmax(CAP * torch.tanh(s / CAP), -1), v)
    close(out, want)


def test_the_selectors_weights_cap_their_scores():
    from icecache.cache.selectors import snap_votes
    from icecache.cache.selectors.h2o import prompt_scores
    from icecache.cache.selectors.tokens import group_weights

    q, keys = rand(3, 16, seed=50).numpy(), rand(10, 16, seed=51).numpy()
    s = q.astype(np.float64) @ keys.T.astype(np.float64) * 0.25
    e = np.exp(CAP * np.tanh(s / CAP))
    np.testing.assert_allclose(group_weights(q, keys, 0.25, CAP), (e / e.sum(1, keepdims=True)).sum(0), rtol=1e-6)
    assert not np.allclose(group_weights(q, keys, 0.25), group_weights(q, keys, 0.25, CAP), rtol=1e-3)
    obs, all_keys = rand(2, 3, 16, seed=52), rand(1, 10, 16, seed=53)
    votes = snap_votes(obs, all_keys, 2, 6, 0.25, CAP)
    w = torch.softmax(soft_cap(obs.reshape(-1, 16) @ all_keys[0].T * 0.25, CAP), -1)
    np.testing.assert_allclose(votes[0], w[:, 2:8].sum(0).double().numpy(), rtol=1e-5)
    pos, weights = np.array([3, 9]), np.array([1.0, 2.0])
    got = prompt_scores(q[:, None].repeat(2, 1), pos, weights, keys, 0, 10, 0.25, CAP)
    want = np.zeros(10)
    for j, p in enumerate(pos):
        e = np.exp(CAP * np.tanh(s[:, : p + 1] / CAP))
        want[: p + 1] += weights[j] * (e / e.sum(1, keepdims=True)).sum(0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
