"""Attention over an ice layer's resident rows: a decode step, and a sparse-prefill chunk.

Each has a plain-torch reference (einsum, float32 softmax) and the fused SDPA version the cache
runs; the tests compare the two. Shapes: ``q`` groups the query heads by KV head, ``k``/``v`` are
the resident rows (sink, pool, window) and ``valid`` masks the rows not in use.

``softcap`` (Gemma 2's ``attn_logit_softcapping``; None: none): the scaled scores are capped,
``cap * tanh(score / cap)`` (:func:`~.chunked.soft_cap`), before any mask or bias. SDPA and the
flash kernel cannot cap, so a capped step takes the reference's explicit products instead.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .chunked import soft_cap


def paged_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                           scaling: float, softcap: float | None = None) -> torch.Tensor:
    """q (H, G, d) query heads grouped by KV head; k, v (H, L, d); valid (H, L) -> (H, G, d).

    Plain softmax attention per KV head over its valid rows, in float32.
    """
    scores = soft_cap(torch.einsum("hgd,hld->hgl", q.float(), k.float()) * scaling, softcap)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgl,hld->hgd", probs, v.float()).to(q.dtype)


def _on_cpu_kernel(q, k, v) -> bool:
    """Whether :func:`~.score_kernels.paged_decode_fused` takes this step (CPU, float32)."""
    return q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32


def _fused(q, k, v, valid, scaling, softcap, place=None) -> torch.Tensor:
    """:func:`~.score_kernels.paged_decode_fused` on torch tensors (``place``: its placement,
    :func:`~.positions.place_tables`)."""
    return paged_decode_placed_rows(q, k.contiguous().numpy(), v.contiguous().numpy(), valid.numpy(), scaling,
                                    softcap, place)


def paged_decode_sdpa(q, k, v, valid, scaling, softcap=None):
    """The same as :func:`paged_decode_reference`, the fast path: on the CPU in float32 one numba
    call (:func:`~.score_kernels.paged_decode_fused`, capped scores too), elsewhere torch's fused
    SDPA; capped scores off the CPU by the reference (one query per head: a few products over
    the resident rows)."""
    if _on_cpu_kernel(q, k, v):
        return _fused(q, k, v, valid, scaling, softcap)
    if softcap:
        return paged_decode_reference(q, k, v, valid, scaling, softcap)
    out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None],
                                         attn_mask=valid[:, None, None, :], scale=scaling)
    return out[:, 0]


def paged_decode_placed(q, k, v, valid, scaling, softcap, frame, sink_fill: int, pool_at: int, window_at: int,
                        pages_at: int, offset, count):
    """:func:`paged_decode_sdpa` over the keys as :func:`~.positions.place_keys` places them
    (remapped positions: the sink and pool rows turned to end at ``pages_at``). On the CPU in
    float32 one numba call turns each row as it scores it (no copy of the keys); elsewhere, and
    as its reference, the placed copy and then :func:`paged_decode_sdpa`."""
    from .positions import place_keys, place_tables

    if _on_cpu_kernel(q, k, v):
        return _fused(q, k, v, valid, scaling, softcap,
                      place_tables(frame, sink_fill, pool_at, window_at, pages_at, offset, count))
    k = place_keys(frame, k, sink_fill, pool_at, window_at, pages_at, offset, count)
    return paged_decode_sdpa(q, k, v, valid, scaling, softcap)


def paged_decode_placed_rows(q: torch.Tensor, keys: np.ndarray, values: np.ndarray, valid: np.ndarray, scaling,
                             softcap, tables: tuple | None) -> torch.Tensor:
    """:func:`paged_decode_placed`'s CPU path over a pool's own float32 NumPy arrays (``keys``,
    ``values`` (H, L, d), ``valid`` (H, L); :meth:`~.resident.ResidentKV.cpu_rows`) and its
    placement already as :func:`~.positions.place_tables` gives it (None: no placement, the rows
    as they are): one numba call, without a decode step's dozen torch conversions a layer."""
    from .score_kernels import paged_decode_fused

    out = np.empty(q.shape, np.float32)
    paged_decode_fused(np.ascontiguousarray(q.numpy()), keys, values, valid, np.float32(scaling),
                       np.float32(softcap or 0.0), out, tables)
    return torch.from_numpy(out)


def weighted_mask(valid: torch.Tensor, bias: torch.Tensor, pool_at: int) -> torch.Tensor:
    """valid (H, L) and per query head log-weights of the pool rows ``bias`` (H, G, R), the pool
    at rows ``pool_at .. pool_at + R`` -> an additive mask (H, G, L): 0 on the other valid rows,
    -inf on the invalid ones."""
    H, L = valid.shape
    G, R = bias.shape[1], bias.shape[2]
    mask = torch.zeros(H, G, L, dtype=torch.float32, device=valid.device)
    mask.masked_fill_(~valid[:, None, :], float("-inf"))
    mask[:, :, pool_at : pool_at + R] += bias.to(mask.device, torch.float32)
    return mask


def paged_decode_weighted_reference(q, k, v, valid, bias, pool_at, scaling, softcap=None):
    """:func:`paged_decode_reference` where a pool row's weight is also multiplied by
    ``exp(bias)`` per query head (a sampled row's inverse sampling chance; -inf: not attended):
    softmax over ``q.k * scaling + bias``, in float32. With ``softcap`` the cap applies to
    ``q.k * scaling`` alone: the bias is the sampling's weight, not part of the score, and the
    self-normalized estimate of the capped softmax weighs each sample ``exp(capped score) / P``."""
    scores = soft_cap(torch.einsum("hgd,hld->hgl", q.float(), k.float()) * scaling, softcap)
    scores = scores + weighted_mask(valid, bias, pool_at)
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgl,hld->hgd", probs, v.float()).to(q.dtype)


def paged_decode_weighted(q, k, v, valid, bias, pool_at, scaling, softcap=None):
    """:func:`paged_decode_weighted_reference` through torch's fused SDPA (capped: the reference)."""
    if softcap:
        return paged_decode_weighted_reference(q, k, v, valid, bias, pool_at, scaling, softcap)
    mask = weighted_mask(valid, bias, pool_at)[:, None].to(q.dtype)  # (H, 1, G, L)
    out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=mask, scale=scaling)
    return out[:, 0]


def paged_decode_rest_reference(q, k, v, valid, groups, scaling, softcap=None):
    """:func:`paged_decode_reference` with estimate rows beside the resident ones (``rest_estimate``,
    :mod:`.rest`): each of ``groups`` is (keys transposed (H, d, P), values (H, P, d), bias
    (H, P)), the bias added to those rows' scores (the log of the rows each stands for; -inf:
    none). Softmax over all, in float32. ``softcap``: every row's ``q.k * scaling`` capped before
    the bias is added (an estimate row's score is its mean key's, capped like a real key's; see
    :mod:`.rest` for why that stays a fair estimate)."""
    keys = torch.cat([k.float()] + [g[0].float().transpose(1, 2) for g in groups], 1)
    values = torch.cat([v.float()] + [g[1].float() for g in groups], 1)
    bias = torch.cat([torch.zeros(valid.shape)] + [g[2].float().cpu() for g in groups], 1)
    allowed = torch.cat([valid.cpu()] + [torch.ones(g[2].shape, dtype=torch.bool) for g in groups], 1)
    scores = soft_cap(torch.einsum("hgd,hld->hgl", q.float(), keys) * scaling, softcap) + bias.to(q.device)[:, None, :]
    scores = scores.masked_fill(~allowed.to(q.device)[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgl,hld->hgd", probs, values).to(q.dtype)


def paged_decode_rest(q, k, v, valid, groups, scaling, softcap=None, rest_q=None):
    """:func:`paged_decode_rest_reference`, computed without concatenating the rows: one score
    product per group (the bias added in the same call), one softmax over the joined scores, one
    product per group with its values (the fast path; at a few hundred estimate rows per head it
    costs a fraction of SDPA over a concatenated copy). ``softcap``: each score capped before its
    bias (the group's score products then add the bias after the cap instead of in the call).
    ``rest_q`` (H, G, d): the query the estimate rows are scored with (default ``q``); with
    remapped positions, ``q`` turned to the one distance they all sit at (their mean keys are
    un-rotated), the same scores as the keys turned there."""
    H, G = q.shape[0], q.shape[1]
    gq = q if rest_q is None else rest_q.to(q.dtype)
    scores = [soft_cap(torch.bmm(q, k.transpose(1, 2)).mul_(scaling), softcap).masked_fill_(~valid[:, None, :],
                                                                                           float("-inf"))]
    for gk, _gv, gb in groups:
        if softcap:
            s = soft_cap(torch.bmm(gq, gk.to(q.dtype)).mul_(scaling), softcap)
            scores.append(s.add_(gb[:, None, :].to(q.dtype)))
        else:
            scores.append(torch.baddbmm(gb[:, None, :].to(q.dtype).expand(H, G, gb.shape[1]), gq,
                                        gk.to(q.dtype), alpha=scaling))
    probs = torch.softmax(torch.cat(scores, -1), dim=-1)
    L = k.shape[1]
    out = torch.bmm(probs[..., :L], v)
    at = L
    for gk, gv, _gb in groups:
        n = gk.shape[2]
        out.baddbmm_(probs[..., at : at + n], gv.to(v.dtype))
        at += n
    return out


def chunk_positions(C: int, n: int) -> np.ndarray:
    """``n`` positions of a chunk of ``C`` queries, evenly spread and ending at the last one."""
    return np.unique(np.linspace(0, C - 1, min(n, C)).round().astype(np.int64)) if C else np.empty(0, np.int64)


def paged_chunk_reference(q, k, v, valid, chunk_at, scaling, softcap=None):
    """A sparse-prefill chunk's attention in plain torch (the reference of :func:`paged_chunk_sdpa`).

    q (H, G, C, d): the chunk's queries grouped by KV head; k, v (H, L, d) the resident rows
    (sink, loaded pages, window, then the chunk itself at rows ``chunk_at`` .. ``chunk_at + C``);
    valid (H, L). Query t sees the valid rows before the chunk and chunk rows up to its own.
    """
    H, G, C, d = q.shape
    mask = chunk_mask(valid, chunk_at, C)  # (H, C, L)
    scores = soft_cap(torch.einsum("hgcd,hld->hgcl", q.float(), k.float()) * scaling, softcap)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgcl,hld->hgcd", probs, v.float()).to(q.dtype)


def chunk_mask(valid: torch.Tensor, chunk_at: int, C: int) -> torch.Tensor:
    H, L = valid.shape
    mask = valid[:, None, :].expand(H, C, L).clone()
    causal = torch.ones(C, C, dtype=torch.bool, device=valid.device).tril()
    mask[:, :, chunk_at : chunk_at + C] &= causal
    return mask


def paged_chunk_flash(q, k, v, valid, chunk_at, scaling, softcap=None):
    """:func:`paged_chunk_reference` on the CPU without a mask (:mod:`.chunked` does the same for a
    dense prefix): the chunk over itself, causally, in one flash call for every query head; per KV
    head, the chunk over that head's valid rows outside the chunk (gathered: heads keep different
    pages) in one maskless call, its query heads stacked along the sequence; the two merged by
    their log-sum-exps. The chunk's own rows must all be valid (:func:`paged_chunk_sdpa`
    otherwise). Capped scores: :func:`paged_chunk_capped` (the flash kernel cannot cap)."""
    H, G, C, d = q.shape
    if softcap:
        return paged_chunk_capped(q, k, v, valid, chunk_at, scaling, softcap)
    if not bool(valid[:, chunk_at : chunk_at + C].all()):
        return paged_chunk_sdpa(q, k, v, valid, chunk_at, scaling)
    from .chunked import merged

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    kc = k[:, chunk_at : chunk_at + C].repeat_interleave(G, dim=0)[None]
    vc = v[:, chunk_at : chunk_at + C].repeat_interleave(G, dim=0)[None]
    own, own_lse = flash(q.reshape(1, H * G, C, d), kc, vc, 0.0, True, scale=scaling)[:2]
    own, own_lse = own.reshape(H, G, C, d), own_lse.reshape(H, G, C)
    outside = valid.clone()
    outside[:, chunk_at : chunk_at + C] = False
    out = own.float()
    for h in range(H):
        rows = outside[h].nonzero().flatten()
        if not len(rows):
            continue
        pre, pre_lse = flash(q[h].reshape(1, 1, G * C, d), k[h, rows][None, None], v[h, rows][None, None],
                             0.0, False, scale=scaling)[:2]
        out[h] = merged(own[h], own_lse[h], pre.reshape(G, C, d), pre_lse.reshape(G, C))
    return out.to(q.dtype)


def paged_chunk_sdpa(q, k, v, valid, chunk_at, scaling, softcap=None):
    """:func:`paged_chunk_reference` through torch's fused SDPA (capped: :func:`paged_chunk_capped`)."""
    H, G, C, d = q.shape
    if softcap:
        return paged_chunk_capped(q, k, v, valid, chunk_at, scaling, softcap)
    mask = chunk_mask(valid, chunk_at, C)[:, None]  # (H, 1, C, L): the group shares it
    kk = k[:, None].expand(H, G, *k.shape[1:])
    vv = v[:, None].expand(H, G, *v.shape[1:])
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scaling)


CAPPED_BLOCK = 256  # queries of a capped chunk scored at a time per KV head


def paged_chunk_capped(q, k, v, valid, chunk_at, scaling, softcap, block: int = CAPPED_BLOCK):
    """:func:`paged_chunk_reference` with capped scores by explicit products, one KV head and
    ``block`` queries at a time (the reference's scores of a whole chunk, every head at once,
    would take gigabytes at a 2048-token chunk), in the query's dtype with a float32 softmax."""
    H, G, C, d = q.shape
    mask = chunk_mask(valid, chunk_at, C)  # (H, C, L)
    out = torch.empty_like(q)
    for h in range(H):
        kt = k[h].to(q.dtype).t()
        for lo in range(0, C, block):
            hi = min(C, lo + block)
            s = soft_cap(torch.matmul(q[h, :, lo:hi], kt).float().mul_(scaling), softcap)  # (G, b, L)
            s.masked_fill_(~mask[h, None, lo:hi], float("-inf"))
            out[h, :, lo:hi] = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v[h]).to(q.dtype)
    return out
