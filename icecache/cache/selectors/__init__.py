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

How to add one: a subclass of :class:`~.base.PageSelector`, the contract an ice layer relies on
(every member it reads, with defaults). Usually through :class:`~.base.HeadIndexes`, which keeps
one index per KV head and the page versions, so only ``new_index`` and perhaps ``select`` are
left; a method that picks single tokens subclasses :class:`~.token_base.TokenSelector` and writes
``choose``. Decorate it with ``@register("name")`` in its own module, import that below, then add
a :class:`~icecache.methods.Method` record naming it. Its parameters are a frozen dataclass, its
``Settings`` attribute: their names become profile keys (shared names mean the same thing).
"""

from __future__ import annotations

from ..spec import IceSpec
from .base import SELECTORS, HeadIndexes, PageSelector, register, settings_for, tunable


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
           "register", "settings_for", "snap_votes", "tunable"]
