"""Warm-up before any timer starts: numba compiles a kernel on its first call (seconds each, cached
on disk afterwards), and a bench must not time that.

:func:`ensure_warm` runs each method once on a short generated prompt (long enough that the ice
methods build, query and insert into their indexes and load pages), a sparse prefill when one
will be timed, and the dense decode kernel; it is idempotent per process, so every bench entry
point calls it before its first timed region. :func:`warm_tree` does the same for the bare index
(``icecache bench index``).
"""

from __future__ import annotations

_done: set = set()


def ensure_warm(loaded, settings, methods, sparse: bool = False) -> None:
    """Each of ``methods`` (and the sparse prefill if ``sparse``) run once, untimed; the stage
    timers synchronized from here on."""
    from ..generation import Session
    from . import sync_timers
    from .decode_bench import context_ids

    sync_timers()
    page = settings.page_size
    n = settings.budget + (settings.sink_pages + settings.window_pages) * page + 16 * page
    s = settings.replace(chunk_size=max(page, n // 4 // page * page), prefill="full",
                         prefill_budget=page * max(1, settings.budget // page // 4))
    todo = [(m, "full") for m in methods] + ([("ice", "sparse")] if sparse else [])
    for method, mode in todo:
        key = (id(loaded), method, mode, settings)
        if key in _done:
            continue
        ids = context_ids(loaded.tokenizer, n)
        Session(loaded, s.replace(prefill=mode), method).generate(ids, 3)
        _done.add(key)
    if ("cache kernels",) not in _done:
        from ..warmup import compile_cache

        compile_cache()
        _done.add(("cache kernels",))


def warm_tree(head_dim: int, group: int) -> None:
    """The index kernels the index bench times, compiled (or loaded from numba's cache) once."""
    from ..warmup import compile_index

    key = ("tree", head_dim, group)
    if key not in _done:
        compile_index(head_dim, group, kv_heads=(1,))
        _done.add(key)
