"""The KV-cache methods a run can use, and the cache object each one puts into the model.

``full`` keeps every key and value (transformers' dense cache and SDPA attention: what a
transformers user gets); ``dense`` is the same attention over the project's in-place growing
dense cache (no per-step copy of the whole cache). ``ice`` is the
IceCache paged cache (:mod:`icecache.cache`); ``ice-reuse`` its variant where only every
``reuse_every``-th layer queries its index. ``streaming`` is the same paged cache with sink and
window pages only (StreamingLLM); ``oracle`` keeps the dense cache and lets each KV head's
query heads attend to the exact top-``budget`` tokens of the group plus sink and window
(``oracle-qhead``: each query head its own top tokens); upper bounds, not methods. The baselines are registered here as they arrive;
naming one that is not built yet is a clear error.
"""

from __future__ import annotations

from typing import Any

from .config import Settings
from .errors import MethodUnavailable, UsageError

AVAILABLE = ("full", "dense", "ice", "ice-reuse", "oracle", "oracle-qhead", "streaming", "quest", "snapkv")
PLANNED: tuple[str, ...] = ()
# The paged cache: streaming selects no pages, quest selects token-order pages by key bounds.
ICE_FAMILY = ("ice", "ice-reuse", "streaming", "quest", "snapkv")
SELECTOR = {"quest": "quest", "snapkv": "snapkv"}


SPARSE_PREFILL = ("ice", "ice-reuse", "streaming", "quest")  # methods a sparse prefill can use


def check_prefill(method: str, settings: Settings) -> None:
    """A sparse prefill selects pages per chunk: only the paged methods with an index can."""
    if settings.prefill == "sparse" and method not in SPARSE_PREFILL:
        raise UsageError(f"--prefill sparse works with {', '.join(SPARSE_PREFILL)}, not '{method}'")


def check_method(method: str) -> str:
    if method in AVAILABLE:
        return method
    if method in PLANNED:
        raise MethodUnavailable(
            f"method '{method}' is not available yet in this version; use one of {', '.join(AVAILABLE)}"
        )
    planned = f"; planned: {', '.join(PLANNED)}" if PLANNED else ""
    raise MethodUnavailable(f"unknown method '{method}' (available: {', '.join(AVAILABLE)}{planned})")


def ice_spec(settings: Settings, pages: bool = True, selector: str = "dci"):
    from .cache import IceSpec
    from .index import IndexConfig

    return IceSpec(
        page_size=settings.page_size,
        budget_pages=settings.budget_pages if pages else 0,
        sink_tokens=settings.sink_pages * settings.page_size,
        window_tokens=settings.window_pages * settings.page_size,
        # About two pages of children per bottom-level parent (1 in 32 promoted at pages of 16).
        index=IndexConfig(page_size=settings.page_size, ratio_bottom=1 / (2 * settings.page_size),
                          beam=settings.index_beam, beam_frac=settings.index_beam_frac),
        selector=selector,
        pipeline=settings.pipeline,
        sparse_prefill=settings.prefill == "sparse",
        prefill_pages=settings.prefill_budget // settings.page_size,
        prefill_queries=settings.prefill_queries,
        chunk_tokens=settings.chunk_size,
        dense_window=settings.dense_window,
        host_dtype=host_dtype(settings),
    )


def host_dtype(settings: Settings) -> str | None:
    """The host store's dtype (None: the KV's own). ``auto`` keeps a float32 model's offloaded
    keys and values in float16 (as llama.cpp's KV cache does by default): half the host memory,
    which a 250k-token context on a 24 GiB machine needs."""
    if settings.host_dtype == "auto":
        return "float16" if settings.dtype == "float32" else None
    return None if settings.host_dtype == settings.dtype else settings.host_dtype


def prepare_model(method: str, model: Any, settings: Settings | None = None) -> None:
    """Select the attention implementation ``method`` needs (the model is shared by runs)."""
    if method in ICE_FAMILY:
        from .cache import register

        name = register()
    elif method in ("oracle", "oracle-qhead"):
        from .cache import oracle

        s = settings or Settings()
        name = oracle.register(s.budget, s.sink_pages * s.page_size, s.window_pages * s.page_size,
                               s.dense_layers, per="query" if method == "oracle-qhead" else "kv")
    elif method == "dense":
        from .cache.attention import register_dense

        name = register_dense()
    else:
        name = "sdpa"
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def make_cache(method: str, model: Any, settings: Settings) -> Any:
    """A fresh cache object for one sequence under ``method``."""
    check_method(method)
    check_prefill(method, settings)
    prepare_model(method, model, settings)
    if method in ICE_FAMILY:
        from .cache import IceCache

        return IceCache(
            model.config.num_hidden_layers,
            ice_spec(settings, pages=method != "streaming", selector=SELECTOR.get(method, "dci")),
            dense_layers=settings.dense_layers,
            reuse_every=settings.reuse_every if method == "ice-reuse" else 1, device=model.device)
    if method == "dense":
        from .cache import DenseCache

        return DenseCache(model.config.num_hidden_layers)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)
