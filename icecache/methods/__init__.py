"""The KV-cache methods a run can use, as data: one frozen record per method.

A :class:`~.registry.Method` says which cache kind holds the sequence (:mod:`.kinds`: its
attention, its cache, its memory), which page selector (``icecache.cache.selectors``) a paged
cache queries, and what the command line may combine it with (a budget, a sparse prefill).
Adding a method is one record in :mod:`.registry` (and, for a new way of choosing pages, one
selector class). :mod:`.planner` decides what one run does (prefill mode, positions, all-dense);
:mod:`.factory` makes its cache.

- ``full``: transformers' own dense cache and SDPA attention (the reference a user knows);
- ``offloaded``: ``full`` with every layer's keys and values in host memory, each layer streamed
  to the GPU for its attention (transformers' offloading; the peer for a KV cache that does not
  fit the card);
- ``dense``: the same attention over the project's in-place growing dense cache;
- ``ice``: the IceCache paged cache; ``ice-reuse``: only every ``reuse_every``-th layer queries
  its index, the others reuse its selection;
- ``streaming`` (sink + window pages only), ``quest`` (token-order pages, key bounds), ``snapkv``
  (the prompt end votes once), ``arkvale`` (page digests, recall), ``h2o`` (heavy hitters),
  ``omnikv`` (filter layers' top tokens reused), ``pqcache`` (product-quantized scores),
  ``magicpig`` (LSH sampling): baselines in the same paged cache (docs/methods.md);
- ``oracle`` / ``oracle-qhead``: exact top tokens over the dense cache, per KV head / per query
  head: upper bounds, not methods.
"""

from __future__ import annotations

from .factory import ice_spec, make_cache
from .kinds import DENSE, OFFLOADED, ORACLE, PAGED, SDPA, CacheKind
from .planner import (
    all_dense,
    dense_clamp,
    dense_kv_dtype,
    dense_plan,
    full_prefill_bytes,
    host_dtype,
    plan_run,
    positions,
    prefill_mode,
    prepare_model,
    prompt_half,
    set_rope,
    tail_steps,
)
from .registry import (
    METHODS,
    OMNIKV_FILTERS,
    Method,
    anchor_layers,
    check_method,
    check_prefill,
    get,
    method_help,
    names,
    reads_prompt_queries,
)

__all__ = ["DENSE", "METHODS", "OFFLOADED", "OMNIKV_FILTERS", "ORACLE", "PAGED", "SDPA", "CacheKind", "Method", "all_dense",
           "anchor_layers", "check_method", "check_prefill", "dense_clamp", "dense_kv_dtype", "dense_plan",
           "full_prefill_bytes", "get", "host_dtype", "ice_spec", "make_cache", "method_help", "names",
           "plan_run", "positions", "prefill_mode", "prepare_model", "prompt_half", "reads_prompt_queries",
           "set_rope", "tail_steps"]
