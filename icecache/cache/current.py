"""The cache the model is running with, for the attention functions.

transformers hands an attention function the layer's query, keys and values but not the cache
object; the caches that need their attention to see them (the ice cache, the oracle's) record
themselves here on every ``update`` (the layer's update runs just before its attention).
The record is a weak reference: a cache the run has let go of is freed at once, not kept
alive (with its host store, gigabytes for a long document) until the next cache records itself.
"""

from __future__ import annotations

import threading
import weakref


class _Current(threading.local):
    def __init__(self):
        self.cache: weakref.ref | None = None  # none recorded on this thread yet


_state = _Current()


def set_current(cache) -> None:
    _state.cache = weakref.ref(cache)


def current():
    """The cache whose layer was updated last on this thread (None before any, or once that
    cache is gone)."""
    ref = _state.cache
    return None if ref is None else ref()


def forget() -> None:
    """Drop the record."""
    _state.cache = None
