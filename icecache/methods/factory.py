"""The cache factory: a fresh cache for one sequence under a method (its kind's
:meth:`~.kinds.CacheKind.make`), and the paged kind's layout (:func:`ice_spec`)."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from .planner import host_dtype, positions, prepare_model
from .registry import Method, check_prefill, get


def walk_dims(model_config, settings: Settings) -> int:
    """Key dimensions a decode step's page searches cover: the sparse layers (global layers
    past ``dense_layers``; a sliding-window layer keeps its window only) x KV heads x head_dim."""
    from ..cache.window import window_sizes
    from ..memory import kv_shape

    layers, heads, head_dim = kv_shape(model_config)
    windows = window_sizes(model_config, layers)
    sparse = sum(1 for i, w in enumerate(windows) if not w and i >= settings.dense_layers)
    return sparse * heads * head_dim


def ice_spec(settings: Settings, method: Method, softcap: float | None = None, walk: int = 0):
    """The paged cache's spec for ``method`` under ``settings`` (budget in pages from here on);
    ``softcap``: the model's cap on its attention scores (Gemma 2), for the selectors; ``walk``:
    the model's :func:`walk_dims` (the DCI selector's auto beam)."""
    from ..cache import IceSpec
    from ..config import selector_settings

    selector = method.selector or "dci"
    return IceSpec(
        page_size=settings.page_size,
        budget_pages=settings.budget_pages if method.budgeted else 0,
        sink_tokens=settings.sink_pages * settings.page_size,
        window_tokens=settings.window_pages * settings.page_size,
        selector=selector,
        tuning=selector_settings(settings, selector),
        pipeline=settings.pipeline,
        sparse_prefill=settings.prefill == "sparse",
        prefill_pages=settings.prefill_budget // settings.page_size,
        tail_pages=min(settings.tail_budget, settings.prefill_budget) // settings.page_size,
        tail_beam_frac=settings.tail_beam_frac,
        prefill_queries=settings.prefill_queries,
        chunk_tokens=settings.chunk_size,
        dense_window=settings.dense_window,
        answer_spans=settings.answer_spans if method.budgeted else 0,
        host_dtype=host_dtype(settings),
        softcap=softcap or None,
        attention_backend=settings.attention_backend,
        walk_dims=walk,
    )


def make_cache(method: str, model: Any, settings: Settings, tokens: int = 0,
               prompt_tokens: int | None = None) -> Any:
    """A fresh cache object for one sequence of about ``tokens`` tokens (prompt + generation;
    it decides ``positions: auto``), ``prompt_tokens`` of them the prompt (unknown: None),
    under ``method``."""
    from ..cache.window import window_sizes

    m = get(method)
    check_prefill(method, settings)
    prepare_model(method, model, settings, tokens)
    if not m.cache.remaps:
        positions(method, model, settings, tokens)  # an explicit remap is an error here
    # the model's sliding-window layers keep their window only
    windows = window_sizes(model.config, model.config.num_hidden_layers)
    return m.cache.make(m, model, settings, tokens, prompt_tokens, windows)
