"""The oracle baseline: exact top-k tokens by attention (the paper's TOP-k), dense cache.

At a decode step every query head attends to the sink tokens, the window tokens and ``budget``
middle tokens chosen exactly from all of them. ``per`` says whose budget it is:

- ``kv`` (default): one set per KV head, the tokens with the largest attention probability for
  any query head of the group: the same resident memory as the paged methods' budget;
- ``query``: one set per query head (its own top tokens), i.e. G times the memory under GQA.

No real system can afford this selection; it bounds what a page selector can reach.
"""

from __future__ import annotations

import torch

NAME = "icecache_oracle"
_registered = False
_spec = {"budget": 256, "sink": 32, "window": 32, "per": "kv"}


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dense = getattr(module, "layer_idx", 0) < _spec.get("dense_layers", 2)
    if query.shape[2] != 1 or dense:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    B, Hq, _, d = query.shape
    H, T = key.shape[1], key.shape[2]
    G = Hq // H
    scale = scaling if scaling is not None else d ** -0.5
    q = query[0, :, 0].view(H, G, d).float()
    k, v = key[0].float(), value[0].float()
    scores = torch.einsum("hgd,htd->hgt", q, k) * scale
    sink, window, budget = _spec["sink"], _spec["window"], _spec["budget"]
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep[..., : min(sink, T)] = True
    keep[..., max(0, T - window) :] = True
    lo, hi = min(sink, T), max(min(sink, T), T - window)
    if hi - lo > budget and _spec["per"] == "query":
        top = scores[..., lo:hi].topk(budget, dim=-1).indices + lo
        keep.scatter_(-1, top, True)
    elif hi - lo > budget:  # one set per KV head: the group's largest probabilities
        probs = torch.softmax(scores, dim=-1)[..., lo:hi].amax(dim=1)  # (H, mid)
        top = probs.topk(budget, dim=-1).indices + lo
        keep.scatter_(-1, top[:, None, :].expand(H, G, budget), True)
    else:
        keep[..., lo:hi] = True
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    out = torch.einsum("hgt,htd->hgd", probs, v).to(query.dtype)
    return out.reshape(1, 1, Hq, d), None


def register(budget: int, sink: int, window: int, dense_layers: int, per: str = "kv") -> str:
    global _registered
    _spec.update(budget=budget, sink=sink, window=window, dense_layers=dense_layers, per=per)
    if not _registered:
        from .attention import register_attention

        register_attention(NAME, oracle_attention)
        _registered = True
    return NAME
