"""Warm-up before any timer starts: numba compiles a kernel on its first call (seconds each, cached
on disk afterwards), and a bench must not time that.

:func:`ensure_warm` runs each method once on a short generated prompt (long enough that the ice
methods build, query and insert into their indexes and load pages), a sparse prefill when one
will be timed, and the dense decode kernel; it is idempotent per process, so every bench entry
point calls it before its first timed region. :func:`warm_tree` does the same for the bare index
(``icecache bench index``).
"""

from __future__ import annotations

import numpy as np

_done: set = set()


def ensure_warm(loaded, settings, methods, sparse: bool = False) -> None:
    """Each of ``methods`` (and the sparse prefill if ``sparse``) run once, untimed."""
    from ..generation import Session
    from .decode_bench import context_ids

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
    if ("dense_scores",) not in _done:
        from ..cache.kernels import dense_scores

        q = np.zeros((2, 3, 8), np.float32)
        dense_scores(q, np.zeros((2, 16, 8), np.float32), 16, np.empty((2, 3, 16), np.float32))
        _done.add(("dense_scores",))


def warm_tree(head_dim: int, group: int, cfg, k: int) -> None:
    """Build, insert into and query a small tree of ``head_dim`` keys with groups of ``group``
    queries (the kernels the index bench times)."""
    from ..index import DCITree

    key = ("tree", head_dim, group, cfg, k)
    if key in _done:
        return
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((4 * k + 512, head_dim)).astype(np.float32)
    tree = DCITree(head_dim, cfg, capacity=len(keys))
    tree.insert(keys[:-cfg.page_size])
    tree.insert(keys[-cfg.page_size :])
    queries = rng.standard_normal((group, head_dim)).astype(np.float32)
    tree.search_group(queries, k)
    tree.select_group(queries, k, max(1, k // cfg.page_size))
    _done.add(key)
