"""Measuring helpers shared by the CLI's live panel, the task commands and the benchmarks.

- :func:`rss_bytes`: the process's resident set size now;
- :class:`PeakRss`: the largest RSS seen while a ``with`` block runs (sampled in a thread);
- :func:`kv_bytes`: a cache's resident KV bytes (device pool and dense layers), host-store bytes,
  and the resident bytes of the layers from ``dense_layers`` on, for any cache a method uses;
- :func:`window_kv`: the part of the resident bytes that the model's sliding-window layers hold.
"""

from __future__ import annotations

import os
import threading


def rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PeakRss:
    """The largest resident set size seen while the ``with`` block runs (sampled)."""

    def __init__(self, every: float = 0.02):
        self.every, self.peak = every, 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.every)

    def __enter__(self) -> PeakRss:
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def kv_bytes(cache, dense_layers: int = 0) -> tuple[int, int, int]:
    """``(device, host, device_of_sparse_layers)`` KV bytes of any cache (``None``: zeros).

    ``device``: resident keys and values (the paged cache's pools and dense layers, a dense
    cache's buffers, transformers' tensors); ``host``: the paged cache's host store;
    ``device_of_sparse_layers``: the resident bytes of the paged layers, or for a dense cache of
    the layers from ``dense_layers`` on (where the paged methods are sparse).
    """
    if cache is None:
        return 0, 0, 0
    if hasattr(cache, "ice_layers"):
        sparse = sum(layer.device_bytes() for layer in cache.ice_layers())
        return int(cache.device_kv_bytes()), int(cache.host_kv_bytes()), int(sparse)
    per = [_layer_bytes(layer) for layer in getattr(cache, "layers", []) if getattr(layer, "keys", None) is not None]
    return int(sum(per)), 0, int(sum(per[dense_layers:]))


def _layer_bytes(layer) -> int:
    """The resident keys and values of one layer of any cache."""
    if hasattr(layer, "device_bytes"):
        return int(layer.device_bytes())
    keys = getattr(layer, "keys", None)
    return 0 if keys is None else 2 * keys.numel() * keys.element_size()


def window_kv(cache) -> tuple[int, int]:
    """``(layers, bytes)``: how many of ``cache``'s layers are the model's sliding-window layers
    (Gemma 3's five in six), and the resident KV bytes they hold, a part of :func:`kv_bytes`'s
    device figure. Every method keeps such a layer to its window, so this part stays the same
    whatever the context's length; (0, 0) for a model without window layers."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    windows = [layer for layer in getattr(cache, "layers", None) or []
               if isinstance(layer, DynamicSlidingWindowLayer)]
    return len(windows), sum(_layer_bytes(layer) for layer in windows)
