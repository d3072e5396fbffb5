"""The attention function registered with transformers for the ice methods.

Prefill chunks and dense layers go to transformers' own SDPA attention (with the same masks).
A decode step of an :class:`~icecache.cache.ice.IceLayer` runs selection, page loading and
attention over sink + selected pages + window; :func:`paged_decode_reference` is that attention
in plain torch (the reference any faster kernel is tested against).
"""

from __future__ import annotations

import time

import torch

NAME = "icecache"
_registered = False


def paged_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                           scaling: float) -> torch.Tensor:
    """q (H, G, d) query heads grouped by KV head; k, v (H, L, d); valid (H, L) -> (H, G, d).

    Plain softmax attention per KV head over its valid rows, in float32.
    """
    scores = torch.einsum("hgd,hld->hgl", q.float(), k.float()) * scaling
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgl,hld->hgd", probs, v.float()).to(q.dtype)


def paged_decode_sdpa(q, k, v, valid, scaling):
    """The same as :func:`paged_decode_reference` through torch's fused SDPA (the fast path)."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None],
                                         attn_mask=valid[:, None, None, :], scale=scaling)
    return out[:, 0]


def ice_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from .ice import IceLayer, current_cache

    cache = current_cache()
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if isinstance(layer, IceLayer) and not layer.decoding and layer.spec.selector == "snapkv":
        layer.obs_q = query[0, :, -layer.spec.observation :].detach()  # the prompt end votes
    if not isinstance(layer, IceLayer) or not layer.decoding or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    B, Hq, _, d = query.shape
    q = query[0, :, 0]  # (Hq, d)
    layer.select(q)
    layer.load()
    t0 = time.perf_counter()
    k, v, valid = layer.resident_kv()
    scale = scaling if scaling is not None else d ** -0.5
    out = paged_decode_sdpa(q.view(layer.H, Hq // layer.H, d), k, v, valid, scale)
    layer.stats.attention_s += time.perf_counter() - t0
    return out.reshape(1, 1, Hq, d), None


def register() -> str:
    """Register the attention and its masks (the same as SDPA's) once; return the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(NAME, ice_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME
