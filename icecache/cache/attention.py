"""The attention function registered with transformers for the ice methods.

Prefill chunks and dense layers go to transformers' own SDPA attention (with the same masks).
A decode step of an :class:`~icecache.cache.ice.IceLayer` runs selection, page loading and
attention over sink + selected pages + window; :func:`paged_decode_reference` is that attention
in plain torch (the reference any faster kernel is tested against).
"""

from __future__ import annotations

import os
import time

import numpy as np
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


DENSE_KERNEL = os.environ.get("ICECACHE_DENSE_KERNEL", "1") != "0"
DENSE_KERNEL_MIN = 4096  # shorter caches: the products below (no hand-off to numba's threads)


def _rows_buffer(t: torch.Tensor):
    """(H, n, d) whose rows are contiguous per head (a growing cache's view of its first n rows)
    as the C-contiguous (H, capacity, d) NumPy array it lies in; None if it is not laid out so."""
    H, n, d = t.shape
    sh, sr, sd = t.stride()
    if sd != 1 or sr != d or sh % d or sh < n * d:
        return None
    return torch.as_strided(t, (H, sh // d, d), (sh, d, 1)).numpy()


def dense_decode(query, key, value, scaling):
    """One query token over a dense cache: each KV head's keys and values are read once, its
    group of query heads in one matrix product (no per-query-head expansion; SDPA's CPU kernel
    took 58 vs 37 ms per layer at 131k tokens). query (1, Hq, 1, d); key, value (1, H, T, d)
    -> (1, 1, Hq, d). Softmax in float32. The reference is :func:`paged_decode_reference` with
    every row valid."""
    Hq, d = query.shape[1], query.shape[3]
    H = key.shape[1]
    q = query[0, :, 0].reshape(H, Hq // H, d)
    T = key.shape[2]
    if (DENSE_KERNEL and T >= DENSE_KERNEL_MIN and key.device.type == "cpu"
            and key.dtype == torch.float32 and query.dtype == torch.float32):
        k = _rows_buffer(key[0])
        if k is not None:  # numba scores the keys (see kernels.dense_scores); torch does the rest
            from .kernels import dense_scores

            scores = torch.empty((H, Hq // H, T), dtype=torch.float32)
            dense_scores(q.detach().contiguous().numpy(), k, T, scores.numpy())
            probs = torch.softmax(scores.mul_(scaling), dim=-1)
            return torch.matmul(probs, value[0]).reshape(1, 1, Hq, d)
    scores = torch.matmul(q, key[0].transpose(-1, -2))  # (H, G, T)
    probs = torch.softmax(scores.float().mul_(scaling), dim=-1).to(value.dtype)
    return torch.matmul(probs, value[0]).reshape(1, 1, Hq, d)


def dense_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``dense`` method's attention: :func:`dense_decode` for a decode step of one
    unpadded sequence, transformers' SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[0] == 1 and query.shape[2] == 1 and attention_mask is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return dense_decode(query, key, value, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)


def chunk_positions(C: int, n: int) -> np.ndarray:
    """``n`` positions of a chunk of ``C`` queries, evenly spread and ending at the last one."""
    return np.unique(np.linspace(0, C - 1, min(n, C)).round().astype(np.int64)) if C else np.empty(0, np.int64)


def paged_chunk_reference(q, k, v, valid, chunk_at, scaling):
    """A sparse-prefill chunk's attention in plain torch (the reference of :func:`paged_chunk_sdpa`).

    q (H, G, C, d): the chunk's queries grouped by KV head; k, v (H, L, d) the resident rows
    (sink, loaded pages, window, then the chunk itself at rows ``chunk_at`` .. ``chunk_at + C``);
    valid (H, L). Query t sees the valid rows before the chunk and chunk rows up to its own.
    """
    H, G, C, d = q.shape
    mask = chunk_mask(valid, chunk_at, C)  # (H, C, L)
    scores = torch.einsum("hgcd,hld->hgcl", q.float(), k.float()) * scaling
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgcl,hld->hgcd", probs, v.float()).to(q.dtype)


def chunk_mask(valid: torch.Tensor, chunk_at: int, C: int) -> torch.Tensor:
    H, L = valid.shape
    mask = valid[:, None, :].expand(H, C, L).clone()
    causal = torch.ones(C, C, dtype=torch.bool, device=valid.device).tril()
    mask[:, :, chunk_at : chunk_at + C] &= causal
    return mask


def paged_chunk_sdpa(q, k, v, valid, chunk_at, scaling):
    """:func:`paged_chunk_reference` through torch's fused SDPA."""
    import torch.nn.functional as F

    H, G, C, d = q.shape
    mask = chunk_mask(valid, chunk_at, C)[:, None]  # (H, 1, C, L): the group shares it
    kk = k[:, None].expand(H, G, *k.shape[1:])
    vv = v[:, None].expand(H, G, *v.shape[1:])
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scaling)


def windowed_dense(query, key, value, sink: int, window: int, scaling):
    """Sparse prefill in a dense layer: the chunk attends to the first ``sink`` tokens and the
    ``window`` tokens before it (plus itself, causally), not to the whole prefix.

    query (1, Hq, C, d); key, value (1, H, n, d) with the chunk as the last C rows.
    """
    import torch.nn.functional as F

    C, n = query.shape[2], key.shape[2]
    w0 = n - C - window
    if w0 <= sink:
        return None  # the whole prefix fits: ordinary causal attention
    k = torch.cat([key[:, :, :sink], key[:, :, w0:]], dim=2)
    v = torch.cat([value[:, :, :sink], value[:, :, w0:]], dim=2)
    L = k.shape[2]
    mask = torch.ones(C, L, dtype=torch.bool, device=query.device)
    mask[:, sink + window :] = torch.ones(C, C, dtype=torch.bool, device=query.device).tril()
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask[None, None], scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def ice_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from .current import current
    from .dense import GrowingLayer
    from .ice import IceLayer

    cache = current()
    layer = cache.layers[module.layer_idx] if cache is not None else None
    B, Hq, C, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    if isinstance(layer, IceLayer) and not layer.decoding and layer.spec.selector == "snapkv":
        layer.obs_q = query[0, :, -layer.spec.observation :].detach()  # the prompt end votes
    if isinstance(layer, GrowingLayer) and C > 1 and cache.spec.sparse_prefill:
        out = windowed_dense(query, key, value, cache.spec.sink_tokens, cache.spec.dense_window, scale)
        if out is not None:
            return out, None
    if isinstance(layer, GrowingLayer):  # a dense layer: the dense method's attention
        return dense_attention(module, query, key, value, attention_mask, scaling=scaling,
                               dropout=dropout, **kwargs)
    if not isinstance(layer, IceLayer) or not layer.decoding:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    H = layer.H
    G = Hq // H
    if C == 1:
        q = query[0, :, 0]  # (Hq, d)
        layer.select(q)
    else:  # a sparse-prefill chunk: a few of its positions choose the pages for all of it
        pos = torch.from_numpy(chunk_positions(C, layer.spec.prefill_queries)).to(query.device)
        qs = query[0][:, pos]  # (Hq, n, d), grouped by KV head (Hq = H * G)
        layer.select(qs.reshape(Hq * len(pos), d), pages=layer.spec.prefill_pages)
    layer.load()
    t0 = time.perf_counter()
    k, v, valid = layer.resident_kv()
    if C == 1:
        out = paged_decode_sdpa(q.view(H, G, d), k, v, valid, scale)
        layer.stats.attention_s += time.perf_counter() - t0
        return out.reshape(1, 1, Hq, d), None
    out = paged_chunk_sdpa(query[0].view(H, G, C, d), k, v, valid, layer.chunk_at, scale)
    layer.after_chunk()
    return out.reshape(Hq, C, d).transpose(0, 1)[None].contiguous(), None


def register_attention(name: str, fn) -> None:
    """Register ``fn`` with transformers' ``AttentionInterface`` under ``name``, with SDPA's
    masks (without a mask function registered, transformers passes a custom attention none)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)


NAMES = {"paged": NAME, "dense": "icecache_dense", "oracle": "icecache_oracle", "record": "icecache_record"}


def _functions() -> dict:
    from .oracle import oracle_attention
    from .record import record_attention

    return {"paged": ice_attention, "dense": dense_attention, "oracle": oracle_attention,
            "record": record_attention}


def register(kind: str = "paged") -> str:
    """Register the attention of a cache kind (``paged``, ``dense``, ``oracle``, ``record``)
    with transformers, once; return its name."""
    global _registered
    if not _registered:
        for k, fn in _functions().items():
            register_attention(NAMES[k], fn)
        _registered = True
    return NAMES[kind]
