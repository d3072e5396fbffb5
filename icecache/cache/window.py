"""Sliding-window attention layers (Gemma 2 and 3, Mistral with a window, Qwen 2 with one).

A layer the model itself restricts to its last ``sliding_window`` tokens reads nothing older, so
the cache keeps only that window resident: no host store, no index, no budget. IceCache and the
dense caches apply to the model's global layers; these layers cost the same at any length.
"""

from __future__ import annotations

from transformers.cache_utils import DynamicSlidingWindowLayer, get_layer_types_and_kwargs

WINDOWED = ("sliding_attention", "chunked_attention")  # transformers' layer types kept as a window


class WindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer (its masks and its cut to the window), with the byte
    count the caches' memory reports read."""

    def device_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return int(self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size())


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
