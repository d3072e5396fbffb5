"""The method records: one frozen :class:`Method` per KV-cache method, and their lookups."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Settings
from ..errors import MethodUnavailable, UsageError
from .kinds import DENSE, OFFLOADED, ORACLE, PAGED, SDPA, CacheKind


@dataclass(frozen=True)
class Method:
    """One KV-cache method.

    ``cache``: its :class:`~.kinds.CacheKind` (``SDPA``: transformers' ``DynamicCache``;
    ``OFFLOADED``: the same with its layers in host memory;
    ``DENSE``: growing dense layers; ``PAGED``: :class:`~icecache.cache.IceCache`; ``ORACLE``:
    dense layers, exact top-k attention). ``selector``: the paged cache's page selector (registry name). ``budgeted``:
    whether ``--budget`` means anything to it. ``sparse_prefill``: whether ``--prefill sparse``
    can run it (a chunk needs pages chosen by an index). ``reuse``: ice-reuse's layer sharing.
    ``oracle_per``: whose budget the oracle's top tokens are (``kv`` or ``query`` head).
    ``reuse_every``: with ``reuse``, the layers an anchor serves (0: the ``reuse_every`` setting).
    ``anchor_depths``: with ``reuse``, the anchor layers instead, as shares of the model's depth
    (:func:`anchor_layers`). ``short_dense``: a run within ``dense_until`` tokens keeps every layer
    dense (:func:`all_dense`).
    """

    name: str
    summary: str
    cache: CacheKind
    selector: str | None = None
    budgeted: bool = True
    sparse_prefill: bool = False
    reuse: bool = False
    oracle_per: str = "kv"
    reuse_every: int = 0
    anchor_depths: tuple[float, ...] = ()
    short_dense: bool = False


# OmniKV's filter layers: 2, 8 and 18 of Llama-3-8B's 32 (the authors' configuration), as shares
# of the depth; the layers before the first are dense.
OMNIKV_FILTERS = (2 / 32, 8 / 32, 18 / 32)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("full", "the whole KV cache, transformers' own (the reference)", SDPA, budgeted=False),
    Method("offloaded", "the whole KV cache in host memory, each layer streamed to the GPU for its "
           "attention (transformers' offloaded cache; on a CPU the same as full)", OFFLOADED, budgeted=False),
    Method("dense", "the whole KV cache, growing in place (no per-step copy)", DENSE, budgeted=False),
    Method("ice", "IceCache: budget pages chosen by the DCI-tree, the rest on the host", PAGED,
           selector="dci", sparse_prefill=True, short_dense=True),
    Method("ice-reuse", "ice where only every --reuse-every-th layer queries its index", PAGED,
           selector="dci", sparse_prefill=True, reuse=True, short_dense=True),
    Method("oracle", "upper bound: exact top tokens per KV head over the dense cache", ORACLE),
    Method("oracle-qhead", "upper bound: exact top tokens per query head (G x the memory)", ORACLE,
           oracle_per="query"),
    Method("streaming", "StreamingLLM: sink and window pages only", PAGED, selector="streaming",
           budgeted=False, sparse_prefill=True),
    Method("quest", "Quest: token-order pages ranked by per-channel key bounds", PAGED,
           selector="quest", sparse_prefill=True),
    Method("snapkv", "SnapKV: the prompt's last queries choose the tokens once", PAGED,
           selector="snapkv"),
    Method("arkvale", "ArkVale: token-order pages by box digests; evicted pages recalled", PAGED,
           selector="arkvale", sparse_prefill=True),
    Method("h2o", "H2O: keep the tokens with the most accumulated attention (evicts for good)", PAGED,
           selector="h2o"),
    Method("omnikv", "OmniKV: filter layers' exact top tokens, reused by the layers up to the next", PAGED,
           selector="omnikv", reuse=True, anchor_depths=OMNIKV_FILTERS),
    Method("pqcache", "PQCache: top tokens by product-quantized key scores", PAGED, selector="pqcache"),
    Method("magicpig", "MagicPIG: LSH-sampled keys, attention by importance sampling", PAGED,
           selector="magicpig"),
)}


def anchor_layers(method: Method, num_layers: int, dense_layers: int) -> frozenset[int] | None:
    """The anchor layers of a method with ``anchor_depths`` in a model of ``num_layers`` (each
    share times the depth, rounded; none before the first sparse layer, which is always one);
    None for the others (``reuse_every`` decides)."""
    if not method.anchor_depths:
        return None
    layers = {min(num_layers - 1, max(dense_layers, round(f * num_layers))) for f in method.anchor_depths}
    return frozenset(layers | {dense_layers})


def reads_prompt_queries(method: Method) -> bool:
    """Whether the method's selector reads the prompt's queries (SnapKV's vote, H2O's scores):
    its prefill is more than keys and values."""
    from ..cache.selectors import SELECTORS

    return method.selector is not None and SELECTORS[method.selector].waits_for_queries


def names() -> tuple[str, ...]:
    return tuple(METHODS)


def method_help() -> str:
    """One line per method, for ``--help``."""
    return "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values())


def get(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise MethodUnavailable(f"unknown method '{name}' (available: {', '.join(METHODS)})") from None


def check_method(method: str) -> str:
    return get(method).name


def check_prefill(method: str, settings: Settings) -> None:
    """A sparse prefill selects pages per chunk: only the paged methods with an index can."""
    if settings.prefill == "sparse" and not get(method).sparse_prefill:
        able = ", ".join(m.name for m in METHODS.values() if m.sparse_prefill)
        raise UsageError(f"--prefill sparse works with {able}, not '{method}'")


