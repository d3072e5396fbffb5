"""Page selectors: how an ice layer chooses the host pages each KV head attends to.

Every selector follows :class:`PageSelector` and is registered by name (``IceSpec.selector``):

====================  ===========================================================================
``dci``               IceCache: a DCI-tree per KV head, pages of similar keys (:mod:`.dci`)
``quest``             Quest: token-order pages ranked by per-channel key bounds (:mod:`.quest`)
``snapkv``            SnapKV: the prompt's last queries choose the tokens once (:mod:`.snapkv`)
``streaming``         StreamingLLM: no pages, sink and window only (:mod:`.streaming`)
``arkvale``           ArkVale: token-order pages, box digests, a resident set that recalls (:mod:`.arkvale`)
``h2o``               H2O: the tokens with the most accumulated attention, evicted for good (:mod:`.h2o`)
``omnikv``            OmniKV: filter layers' exact top tokens, reused by the next layers (:mod:`.omnikv`)
``pqcache``           PQCache: top tokens by product-quantized key scores (:mod:`.pqcache`)
``magicpig``          MagicPIG: SimHash samples, attention by importance sampling (:mod:`.magicpig`)
====================  ===========================================================================

(The ``oracle`` bound chooses tokens, not pages, over a dense cache: :mod:`icecache.cache.oracle`.)

How to add one: a class with the protocol's members (usually a subclass of
:class:`~.base.HeadIndexes`, which keeps one index per KV head and the page versions, so only
``new_index`` and perhaps ``select`` are left; a method that picks single tokens subclasses
:class:`~.token_base.TokenSelector` and writes ``choose``), decorated with ``@register("name")`` in its own
module, imported below; then a :class:`~icecache.methods.Method` record naming it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ..spec import IceSpec
from .base import SELECTORS, HeadIndexes, register


class PageSelector(Protocol):
    """One ice layer's page choice. Point ids are host-store rows (offloaded tokens in order)."""

    indexed: bool  # False: selects nothing, keeps no index (the pool has no slots)
    waits_for_queries: bool  # needs the prompt's last queries before the prompt is offloaded
    budget_in_index: bool  # its index holds a choice made for one budget (no IceCache.forked)

    def observe(self, queries: torch.Tensor, positions: np.ndarray | None = None) -> None:
        """The prompt's queries at a prefill chunk (query heads, chunk, head_dim), at prompt
        ``positions`` (None: the chunk after the last one observed)."""

    def build(self, prompt_keys: torch.Tensor, lo: int, hi: int, capacity: int,
              middle: torch.Tensor | None = None) -> None:
        """Index the offloaded prompt tokens ``lo .. hi-1`` of ``prompt_keys`` (heads, T, d)
        as points ``0 .. hi-lo-1``, one index per KV head; ``capacity``: the points expected
        in all; ``middle``: those tokens' keys as the host store holds them (un-rotated when
        positions are remapped), if not ``prompt_keys[:, lo:hi]``."""

    def insert(self, keys: torch.Tensor) -> None:
        """Index newly offloaded keys (heads, m, d) on the host, as the next point ids."""

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        """queries (heads, group, d) float32 -> per KV head at most ``max_pages`` page ids.
        ``wide``: an approximate search covers at least this share of the indexed keys (1: an
        exact search); exact selectors ignore it."""

    # Optional: ``select_prefill(queries, max_pages, wide) -> page ids``, the choice for a sparse
    # prefill (a chunk's few choosing positions, or one of the prompt's last steps) when it
    # differs from a decode step's (``dci`` with token_pick: whole pages in the prefill, picked
    # tokens after it); ``select`` otherwise.

    def page_table(self, head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Head ``head``'s pages: members (pages, page_size) point ids, count (pages,), and
        version (pages,): a page whose members changed has a higher version."""

    def release(self) -> None:
        """Drop the index (the host store stays)."""


def make_selector(spec: IceSpec) -> PageSelector:
    try:
        cls = SELECTORS[spec.selector]
    except KeyError:
        raise ValueError(f"unknown page selector '{spec.selector}' (known: {', '.join(SELECTORS)})") from None
    return cls(spec)


from . import arkvale, dci, h2o, magicpig, omnikv, pqcache, quest, snapkv, streaming  # noqa: E402,F401
from .quest import QuestIndex  # noqa: E402
from .snapkv import SnapIndex, snap_votes  # noqa: E402

__all__ = ["SELECTORS", "HeadIndexes", "PageSelector", "QuestIndex", "SnapIndex", "make_selector",
           "register", "snap_votes"]
