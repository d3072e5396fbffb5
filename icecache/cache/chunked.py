"""A prompt chunk's attention on the CPU without a materialized mask.

In a chunked prefill, a chunk of C queries attends to every one of the T - C rows before it and
causally to its own C rows. transformers hands SDPA that pattern as a (C, T) boolean mask, and
torch's CPU kernel then reads the mask at every block instead of skipping the blocks it hides (and
converts it for every layer). At 8k tokens the attention of the last chunk took 70% of that
chunk's prefill time (docs/results.md, "Prefill").

:func:`prefix_causal` computes the same attention with two calls of torch's CPU flash kernel and
no mask: the chunk over the prefix (every row visible; the query heads of one KV head stacked along
the sequence, so the prefix is read once per KV head and never copied per query head), and the
chunk over itself with ``is_causal``. The two partial results are merged by their log-sum-exps.
:func:`prefix_causal_reference` is SDPA with the mask (what transformers computes); the tests
compare the two.

:func:`sdpa_forward` is transformers' ``sdpa_attention_forward`` with this path taken where it
applies: on the CPU, one sequence, a chunk of more than one query, no dropout, and a mask that is
exactly the prefix-causal pattern (checked once per mask object: transformers builds one mask per
forward and passes it to every layer), or no mask with the chunk as the whole sequence.

Capped scores (Gemma 2's ``attn_logit_softcapping``: ``cap * tanh(score / cap)`` after the
scaling, :func:`soft_cap`): neither torch's SDPA nor its flash kernel can apply a cap, and
transformers' SDPA refuses one. A capped chunk is therefore computed by explicit products,
block by block (:func:`prefix_causal_half` in the query's dtype, or :func:`capped_attention`
under any other mask).
"""

from __future__ import annotations

import torch

# the last mask checked, for C queries over T rows, and whether it was the prefix-causal pattern (one mask per forward: the
# reference keeps it alive, so ``is`` cannot match a new mask at a reused address)
_checked: list = [None, 0, 0, False]


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``scores`` (already scaled) capped in place as ``cap * tanh(scores / cap)`` (Gemma 2's
    ``attn_logit_softcapping``), and returned; untouched when ``cap`` is None or 0 (no cap: the
    uncapped paths do no extra work). Masks go on after the cap (a capped -inf would be -cap)."""
    if cap:
        scores.div_(cap).tanh_().mul_(cap)
    return scores


def prefix_causal_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            scaling: float, softcap: float | None = None) -> torch.Tensor:
    """query (1, Hq, C, d); key, value (1, H, T, d), the chunk being the last C rows -> (1, Hq, C, d):
    SDPA with the prefix-causal mask (row i sees rows 0 .. T - C + i); with ``softcap``, the same
    by explicit products with the capped scores (SDPA cannot cap)."""
    C, T = query.shape[2], key.shape[2]
    mask = torch.ones(C, T, dtype=torch.bool, device=query.device).tril(diagonal=T - C)
    if softcap:
        return capped_attention(query, key, value, mask[None, None], scaling, softcap).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask[None, None], scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])


HALF_BLOCK = 128  # queries of one KV head's group per product (at 8k: 147 ms a chunk, 256: 246)


def prefix_causal_half(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                       half: torch.dtype, block: int = HALF_BLOCK, softcap: float | None = None) -> torch.Tensor:
    """:func:`prefix_causal_reference` by 16-bit matrix products (``half``, e.g. bfloat16, with
    float32 sums), softmax in float32: for each KV head, ``block`` queries of each head of its group
    at a time over the rows they see. torch's CPU flash kernel runs no faster in bfloat16, but its
    plain bfloat16 products ran 3-4x float32's on AVX512-BF16 (docs/results.md, "Prefill"): a chunk
    of 2048 over 8192 rows took 147 against 216 ms. ``softcap``: the scores capped
    (:func:`soft_cap`) before the mask; ``half`` may then be the query's own dtype (the capped
    path of any chunk: the flash kernel cannot cap)."""
    _, Hq, C, d = query.shape
    H, T = key.shape[1], key.shape[2]
    G, P = Hq // H, T - C
    out = torch.empty(1, Hq, C, d, dtype=query.dtype, device=query.device)
    k, v = key[0].to(half), value[0].to(half)
    q = (query[0] * scaling).to(half).reshape(H, G, C, d)
    above = torch.ones(block, block, dtype=torch.bool, device=query.device).triu(1)
    for h in range(H):
        for lo in range(0, C, block):
            hi = min(C, lo + block)
            b, n = hi - lo, P + hi  # the block's last query sees n rows
            s = soft_cap(torch.mm(q[h, :, lo:hi].reshape(G * b, d), k[h, :n].t()).float().view(G, b, n), softcap)
            s[:, :, P + lo :].masked_fill_(above[:b, :b], float("-inf"))
            p = torch.softmax(s, dim=-1).to(half).view(G * b, n)
            out[0, h * G : (h + 1) * G, lo:hi] = torch.mm(p, v[h, :n]).view(G, b, d).to(query.dtype)
    return out


def prefix_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                  softcap: float | None = None) -> torch.Tensor:
    """:func:`prefix_causal_reference` by two maskless calls of the CPU flash kernel, merged by
    their log-sum-exps (float32); inside ``prompt_products(half)``, :func:`prefix_causal_half`,
    which also computes capped scores (``softcap``; in the query's dtype outside
    ``prompt_products``)."""
    from ..weights import prompt_half

    half = prompt_half()
    if half is not None and query.dtype != half:
        return prefix_causal_half(query, key, value, scaling, half, softcap=softcap)
    if softcap:
        return prefix_causal_half(query, key, value, scaling, query.dtype, softcap=softcap)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, Hq, C, d = query.shape
    H, T = key.shape[1], key.shape[2]
    G, P = Hq // H, T - C
    ks, vs = key[:, :, P:], value[:, :, P:]
    if G > 1:
        ks, vs = ks.repeat_interleave(G, dim=1), vs.repeat_interleave(G, dim=1)
    own, own_lse = flash(query, ks, vs, 0.0, True, scale=scaling)[:2]
    if P == 0:
        return own
    stacked = query.reshape(1, H, G * C, d)  # query head h * G + g reads KV head h
    pre, pre_lse = flash(stacked, key[:, :, :P], value[:, :, :P], 0.0, False, scale=scaling)[:2]
    return merged(own, own_lse, pre.reshape(1, Hq, C, d), pre_lse.reshape(1, Hq, C)).to(query.dtype)


def merged(a: torch.Tensor, a_lse: torch.Tensor, b: torch.Tensor, b_lse: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint sets of rows, from each set's output (..., d) and log-sum-exp
    (...): the softmax-weighted mean of the two, in float32."""
    top = torch.maximum(a_lse, b_lse)
    wa = torch.exp(a_lse - top)[..., None]
    wb = torch.exp(b_lse - top)[..., None]
    return (a.float() * wa + b.float() * wb) / (wa + wb)


def is_prefix_causal(mask: torch.Tensor | None, C: int, T: int) -> bool:
    """Whether ``mask`` (transformers' SDPA mask for a chunk of C queries over T rows) is the
    prefix-causal pattern: boolean, one sequence, every head alike."""
    if mask is None:
        return False
    if _checked[0] is mask and _checked[1:3] == [C, T]:
        return _checked[3]
    # read in place: every row sees the whole prefix, and the chunk's own C x C block is the
    # lower triangle (no T-wide copy: a forced full prefill of a long prompt has a large mask)
    ok = (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1
          and tuple(mask.shape[2:]) == (C, T)
          and bool(mask[0, 0, :, : T - C].all())
          and torch.equal(mask[0, 0, :, T - C :], torch.ones(C, C, dtype=torch.bool, device=mask.device).tril()))
    _checked[:] = [mask, C, T, ok]
    return ok


def capped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float, softcap: float | None) -> torch.Tensor:
    """transformers' eager attention with capped scores (what Gemma 2's own eager attention
    computes): query (B, Hq, C, d); key, value (B, H, T, d); ``mask`` SDPA's (boolean: True
    where a row is seen, or additive), broadcast over (B, Hq, C, T), or None (C > 1: causal,
    the chunk being the last C rows) -> (B, C, Hq, d). Softmax in float32."""
    B, Hq, C, d = query.shape
    H, T = key.shape[1], key.shape[2]
    if Hq != H:
        key, value = key.repeat_interleave(Hq // H, dim=1), value.repeat_interleave(Hq // H, dim=1)
    scores = soft_cap(torch.matmul(query, key.transpose(2, 3)).float().mul_(scaling), softcap)
    if mask is None and C > 1:
        mask = torch.ones(C, T, dtype=torch.bool, device=query.device).tril(diagonal=T - C)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' ``sdpa_attention_forward``, with :func:`prefix_causal` for a prefix-causal
    chunk on the CPU; capped scores (a ``softcap``, which SDPA refuses) by
    :func:`prefix_causal` where the mask is that pattern, else :func:`capped_attention`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    C, T = query.shape[2], key.shape[2]
    softcap = kwargs.get("softcap")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if (query.device.type == "cpu" and query.shape[0] == 1 and C > 1 and T >= C and not dropout
            and kwargs.get("position_bias") is None
            and kwargs.get("s_aux") is None and kwargs.get("is_causal", getattr(module, "is_causal", True))
            and query.shape[1] % key.shape[1] == 0
            and ((attention_mask is None and T == C) or is_prefix_causal(attention_mask, C, T))):
        return prefix_causal(query, key, value, scale, softcap).transpose(1, 2).contiguous(), None
    if softcap is not None:
        if dropout or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
            raise ValueError("capped attention scores with dropout, a position bias or sinks are not supported")
        return capped_attention(query, key, value, attention_mask, scale, softcap), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)
