"""The cache the model is running with, for the attention functions.

transformers hands an attention function the layer's query, keys and values but not the cache
object; the caches that need their attention to see them (the ice cache, the oracle's) record
themselves here on every ``update`` (the layer's update runs just before its attention).
"""

from __future__ import annotations

import threading

_state = threading.local()


def set_current(cache) -> None:
    _state.cache = cache


def current():
    """The cache whose layer was updated last on this thread (None before any)."""
    return getattr(_state, "cache", None)


def forget() -> None:
    """Drop the pointer (it would keep a finished cache's memory alive until the next run)."""
    _state.cache = None
