"""A dense KV layer that grows in place, and the ``dense`` cache built from it.

transformers' ``DynamicLayer`` concatenates every new token onto the whole cache: at 32k tokens
that is a 25 MB copy per layer, per K and per V, at every decode step (about 8 ms per copy on
this machine's CPU, more than the attention itself). :class:`GrowingLayer` keeps keys and values
in a buffer with spare capacity (growing by an eighth when full: at most 12.5% unused, and
an amortized copy of 8 rows per new row) and hands out views of the filled part, so a
decode step writes one row. Decode attention then goes through transformers' SDPA path, which
for one query token packs the GQA group (each KV head is read once, not expanded per query
head). The ice cache's first (dense) layers use this layer; the ``dense`` method uses it for all.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` semantics (``keys``/``values`` are (B, H, n, d)) with in-place growth."""

    min_capacity = 256

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self._n = 0

    def _reserve(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self._k is None else self._k.shape[2]
        if need <= cap:
            return
        new_cap = max(need + self.min_capacity, cap + cap // 8)
        B, H, _, dk = like_k.shape
        k = torch.empty((B, H, new_cap, dk), dtype=like_k.dtype, device=like_k.device)
        v = torch.empty((B, H, new_cap, like_v.shape[3]), dtype=like_v.dtype, device=like_v.device)
        if self._n:
            k[:, :, : self._n] = self._k[:, :, : self._n]
            v[:, :, : self._n] = self._v[:, :, : self._n]
        self._k, self._v = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if self._k is not None and key_states.shape[0] != self._k.shape[0]:
            raise ValueError("batch size changed within one cache")
        self._reserve(self._n + q, key_states, value_states)
        self._k[:, :, self._n : self._n + q] = key_states
        self._v[:, :, self._n : self._n + q] = value_states
        self._n += q
        self.keys = self._k[:, :, : self._n]
        self.values = self._v[:, :, : self._n]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._n = max(0, self._n + tokens_to_remove)
        self.keys = self._k[:, :, : self._n]
        self.values = self._v[:, :, : self._n]

    def reset(self) -> None:
        self._k = self._v = None
        self._n = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("GrowingLayer holds a fixed batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("GrowingLayer holds a fixed batch")

    def device_bytes(self) -> int:
        """Bytes the layer holds (its whole buffer, spare capacity included)."""
        if not self.is_initialized or self._k is None:
            return 0
        return int(self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size())


class DenseCache(Cache):
    """Every layer a :class:`GrowingLayer`: full attention without the per-step concatenation."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[GrowingLayer() for _ in range(num_layers)])

    def device_kv_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers)
