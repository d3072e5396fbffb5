"""Sliding-window attention layers (Gemma 2 and 3, Mistral with a window, Qwen 2 with one).

A layer the model itself restricts to its last ``sliding_window`` tokens reads nothing older, so
the cache keeps only that window resident: no host store, no index, no budget. IceCache and the
dense caches apply to the model's global layers; these layers cost the same at any length.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, get_layer_types_and_kwargs

WINDOWED = ("sliding_attention", "chunked_attention")  # transformers' layer types kept as a window


class WindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer (its masks and its cut to the window), with the byte
    count the caches' memory reports read, and a ring for decode steps.

    transformers' layer joins its rows and the new one and cuts the last ``sliding_window - 1``
    every step: a copy of the whole window a layer a token (Gemma 3's 512 rows of 256: about
    0.2 ms a layer on a 2-core CPU). Here a step of one row keeps the window in a ring of
    ``sliding_window`` rows instead, the row of position ``p`` in slot ``p % sliding_window``:
    the new row is written in place of the one leaving the window, and the step's keys and
    values are the ring's first ``min(seen, sliding_window)`` rows as they lie (attention
    weighs rows alike whatever their order, and a one-row query sees its whole window).
    ``keys``/``values`` then hold the ring; a prompt chunk, a crop or a batch change first puts
    the rows back in order, transformers' layout (:meth:`ordered`)."""

    _ring: tuple | None = None  # (keys, values), (B, H, sliding_window, d) each, while decoding

    def __getstate__(self):
        """A copy (a forked cache) leaves out the fused step's lists of the cache's buffers
        (``_fused_rows``, :func:`~icecache.fused_step.run_layers`; remade at the next step)."""
        state = self.__dict__.copy()
        state.pop("_fused_rows", None)
        return state

    def device_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return int(self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size())

    def ring_slot(self) -> tuple[int, int]:
        """Before a decode step's row: the ring (made at the first step from the window's rows in
        their slots); (the slot the step's row goes to, the rows the step attends to)."""
        n, W = self.cumulative_length, self.sliding_window
        if self._ring is None:
            B, H, m, _ = self.keys.shape
            ring = (self.keys.new_zeros((B, H, W, self.keys.shape[3])),
                    self.values.new_zeros((B, H, W, self.values.shape[3])))
            slots = torch.arange(n - m, n) % W
            ring[0][:, :, slots] = self.keys
            ring[1][:, :, slots] = self.values
            self._ring = ring
        return n % W, min(n + 1, W)

    def ring_step(self) -> None:
        """After a decode step wrote its row at :meth:`ring_slot`'s slot: the row counted."""
        self.cumulative_length += 1
        rows = min(self.cumulative_length, self.sliding_window)
        self.keys, self.values = self._ring[0][:, :, :rows], self._ring[1][:, :, :rows]

    def in_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values in position order, as transformers' layer keeps them (the
        last ``sliding_window - 1`` rows; copies where they lie in the ring)."""
        if self._ring is None:
            return self.keys, self.values
        n, W = self.cumulative_length, self.sliding_window
        slots = torch.arange(n - min(n, W - 1), n) % W
        return self._ring[0][:, :, slots], self._ring[1][:, :, slots]

    def ordered(self) -> None:
        """The rows put back in position order (:meth:`in_order`) and the ring dropped."""
        if self._ring is not None:
            self.keys, self.values = self.in_order()
            self._ring = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if (key_states.shape[-2] == 1 and self.is_initialized and not self.record_past
                and self.keys.dim() == 4 and key_states.shape[0] == self.keys.shape[0]):
            slot, _ = self.ring_slot()
            self._ring[0][:, :, slot] = key_states[:, :, 0]
            self._ring[1][:, :, slot] = value_states[:, :, 0]
            self.ring_step()
            return self.keys, self.values
        self.ordered()
        return super().update(key_states, value_states, *args, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        self.ordered()
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self.ordered()
        super().reset()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.ordered()
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.ordered()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.ordered()
        super().batch_select_indices(indices)


def kv_in_order(layer) -> tuple:
    """A cache layer's keys and values in position order (a window layer's ring put in order)."""
    return layer.in_order() if isinstance(layer, WindowLayer) else (layer.keys, layer.values)


def window_or(windows: list[int] | None, i: int, other):
    """Layer ``i`` of a cache: a :class:`WindowLayer` where ``windows`` gives it a window, else
    ``other()`` (the cache's own kind of layer)."""
    return WindowLayer(windows[i]) if windows and windows[i] else other()


def seen(layer, tokens: int) -> None:
    """A cache layer filled from saved or shared keys: a sliding-window layer, which may have been
    given its window's rows alone, has seen ``tokens`` all the same (its masks and the next
    positions count from there)."""
    if layer.is_sliding:
        layer.cumulative_length = tokens


def window_sizes(config, num_layers: int) -> list[int]:
    """Each layer's sliding window in tokens (0: a global layer), as transformers' own cache reads
    a config (``layer_types``, else a ``sliding_window`` on every layer). ``ValueError`` naming a
    layer kind that is neither (linear attention, compressed layers, ...)."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    out = []
    for kind, kw in zip(types[:num_layers], kwargs[:num_layers], strict=True):
        if kind in WINDOWED:
            out.append(int(kw["sliding_window"]))
        elif kind == "full_attention":
            out.append(0)
        else:
            raise ValueError(f"layers of kind '{kind}' are not supported (full and sliding-window attention are)")
    return out
