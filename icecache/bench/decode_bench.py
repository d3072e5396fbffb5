"""``icecache bench decode``: time per output token and resident KV bytes, per method, same run.

For each context length, generated text of that many tokens goes once through the model's own
chunked full-attention prefill (every method prefills with full attention); each method starts
from a copy of that KV in its own cache, and ``steps`` decode steps are timed one by one after
``warmup`` untimed ones (the first of which builds the index: it is in the time to the second
token, ``tt2t_s`` = the shared prefill + the first decode step).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..generation import Prefilled, Session, prefill_once
from ..measure import kv_bytes
from ..textgen import generated_text
from .warm import ensure_warm


@dataclass
class DecodeResult:
    method: str
    ctx: int
    budget: int
    prefill_s: float
    tt2t_s: float  # prefill + first decode step (index build included): time to the second token
    tpot_ms: float
    tpot_p90_ms: float
    device_kv_bytes: int
    host_kv_bytes: int
    device_kv_bytes_sparse_layers: int  # layers from dense_layers on (where ice is sparse)
    breakdown_ms: dict = field(default_factory=dict)
    pages_loaded_per_step: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def context_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    ids: list[int] = []
    words = n
    while len(ids) < n:
        ids = tokenizer(generated_text(words, seed))["input_ids"]
        words = int(words * 1.3) + 16
    return ids[:n]


def prefill(loaded, settings, ctx: int, on_progress=None) -> Prefilled:
    """The model's own chunked full-attention prefill of ``ctx`` generated tokens, once.

    Every method's prefill is full attention, so each method then starts from a copy of this KV
    (:meth:`~icecache.generation.Session.adopt`). ``on_progress(done, total)``.
    """
    ensure_warm(loaded, settings, [])
    ids = context_ids(loaded.tokenizer, ctx)
    report = (lambda _phase, d, t: on_progress(d, t)) if on_progress else None
    return prefill_once(loaded, settings, ids, on_progress=report)


def run(loaded, settings, method: str, ctx: int, steps: int = 16, warmup: int = 2,
        on_progress=None, shared=None) -> DecodeResult:
    """Decode timing for ``method``; ``shared`` = a :func:`prefill` result to start from."""
    ensure_warm(loaded, settings, [method])
    pre = shared or prefill(loaded, settings, ctx, on_progress)
    session = Session(loaded, settings, method)
    session.adopt(pre)
    return time_decode(session, pre.logits, pre.seconds, steps, warmup)


def time_decode(session, logits, prefill_s: float, steps: int = 16,
                warmup: int = 2, on_step=None) -> DecodeResult:
    """Time ``steps`` greedy decode steps of a session whose cache holds the prompt, after
    ``warmup`` untimed ones (the first of which builds the index when the cache is not built
    yet: it counts in the time to the second token, ``prefill_s`` + that step)."""
    settings, method = session.settings, session.method
    ids = session.cached_ids
    t0 = time.perf_counter()
    with torch.inference_mode():
        token = int(torch.argmax(logits))
        times = []
        stats0 = None
        for i in range(warmup + steps):
            t = time.perf_counter()
            logits = session.forward([token])
            dt = time.perf_counter() - t
            if i == 0:
                tt2t = prefill_s + time.perf_counter() - t0
            token = int(torch.argmax(logits))
            if i == warmup - 1 or (warmup == 0 and i == 0):
                stats0 = _stats(session.cache)
            if i >= warmup:
                times.append(dt)
            if on_step is not None:  # (steps done, steps in all, timed step seconds, session)
                on_step(i + 1, warmup + steps, times, session)
    dev, host, sparse = kv_bytes(session.cache, settings.dense_layers)
    breakdown, loaded_pages = {}, 0.0
    s1 = _stats(session.cache)
    if s1 and stats0:
        n = len(times)
        breakdown = {
            "index_query": 1000 * (s1["query_s"] - stats0["query_s"]) / n,
            "page_loading": 1000 * (s1["load_s"] - stats0["load_s"]) / n,
            "ice_attention": 1000 * (s1["attention_s"] - stats0["attention_s"]) / n,
        }
        breakdown["rest_of_model"] = 1000 * float(np.median(times)) - sum(breakdown.values())
        loaded_pages = (s1["pages_loaded"] - stats0["pages_loaded"]) / n
    return DecodeResult(
        method=method, ctx=len(ids) - warmup - steps, budget=settings.budget, prefill_s=prefill_s,
        tt2t_s=tt2t, tpot_ms=1000 * float(np.median(times)),
        tpot_p90_ms=1000 * float(np.percentile(times, 90)),
        device_kv_bytes=dev, host_kv_bytes=host, device_kv_bytes_sparse_layers=sparse,
        breakdown_ms=breakdown,
        pages_loaded_per_step=loaded_pages)


def _stats(cache):
    st = getattr(cache, "stats", None)
    if st is None:
        return None
    return {"query_s": st.query_s, "load_s": st.load_s, "attention_s": st.attention_s,
            "pages_loaded": st.pages_loaded}
