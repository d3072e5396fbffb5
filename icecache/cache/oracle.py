"""The oracle bound: exact top-k tokens by attention (the paper's TOP-k) over a dense cache.

At a decode step every query head attends to the sink tokens, the window tokens and ``budget``
middle tokens chosen exactly from all of them. ``per`` says whose budget it is:

- ``kv`` (default): one set per KV head, the tokens with the largest attention probability for
  any query head of the group: the same resident memory as the paged methods' budget;
- ``query``: one set per query head (its own top tokens), i.e. G times the memory under GQA.

No real system can afford this selection; it bounds what a page selector can reach. Its settings
travel with its cache (:class:`OracleCache`), which the attention finds through
:mod:`icecache.cache.current`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from . import current
from .chunked import sdpa_forward, soft_cap
from .dense import GrowingLayer
from .window import WindowLayer, window_or


@dataclass(frozen=True)
class OracleSpec:
    budget: int = 256  # middle tokens kept per KV head (per query head with per="query")
    sink: int = 32
    window: int = 32
    dense_layers: int = 2  # layers below this attend to everything
    per: str = "kv"  # "kv" or "query"

    def keep(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (H, G, T) of one decode step -> the tokens each query head attends to."""
        H, G, T = scores.shape
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[..., : min(self.sink, T)] = True
        keep[..., max(0, T - self.window) :] = True
        lo, hi = min(self.sink, T), max(min(self.sink, T), T - self.window)
        if hi - lo <= self.budget:
            keep[..., lo:hi] = True
        elif self.per == "query":
            top = scores[..., lo:hi].topk(self.budget, dim=-1).indices + lo
            keep.scatter_(-1, top, True)
        else:  # one set per KV head: the group's largest probabilities
            probs = torch.softmax(scores, dim=-1)[..., lo:hi].amax(dim=1)  # (H, mid)
            top = probs.topk(self.budget, dim=-1).indices + lo
            keep.scatter_(-1, top[:, None, :].expand(H, G, self.budget), True)
        return keep


class OracleCache(Cache):
    """Dense growing layers carrying the oracle's spec for its attention (a model's sliding-window
    layers: their window, attended in full)."""

    def __init__(self, num_layers: int, spec: OracleSpec, windows: list[int] | None = None):
        super().__init__(layers=[window_or(windows, i, GrowingLayer) for i in range(num_layers)])
        self.spec = spec

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        current.set_current(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def device_kv_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers)


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A decode step of a sparse layer: each query head over its kept tokens; SDPA otherwise."""

    cache = current.current()
    spec = cache.spec if isinstance(cache, OracleCache) else OracleSpec()
    layer_idx = getattr(module, "layer_idx", 0)
    window = isinstance(cache, OracleCache) and isinstance(cache.layers[layer_idx], WindowLayer)
    if query.shape[2] != 1 or layer_idx < spec.dense_layers or window:
        return sdpa_forward(module, query, key, value, attention_mask, scaling=scaling,
                            dropout=dropout, **kwargs)
    B, Hq, _, d = query.shape
    H = key.shape[1]
    G = Hq // H
    scale = scaling if scaling is not None else d ** -0.5
    q = query[0, :, 0].view(H, G, d).float()
    k, v = key[0].float(), value[0].float()
    scores = soft_cap(torch.einsum("hgd,htd->hgt", q, k) * scale, kwargs.get("softcap"))  # kept by capped scores
    probs = torch.softmax(scores.masked_fill(~spec.keep(scores), float("-inf")), dim=-1)
    out = torch.einsum("hgt,htd->hgd", probs, v).to(query.dtype)
    return out.reshape(1, 1, Hq, d), None
