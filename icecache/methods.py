"""The KV-cache methods a run can use, as data: one frozen record per method.

A :class:`Method` says which attention function the model runs with, which cache object holds
the sequence, which page selector (``icecache.cache.selectors``) an ice-family cache queries, and
what the command line may combine it with (a budget, a sparse prefill). Adding a method is one
record here (and, for a new way of choosing pages, one selector class).

- ``full``: transformers' own dense cache and SDPA attention (the reference a user knows);
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

from dataclasses import dataclass
from typing import Any

from .config import Settings
from .errors import MethodUnavailable, UsageError


@dataclass(frozen=True)
class Method:
    """One KV-cache method.

    ``cache``: ``"sdpa"`` (transformers' ``DynamicCache``), ``"dense"`` (growing dense layers),
    ``"paged"`` (:class:`~icecache.cache.IceCache`) or ``"oracle"`` (dense layers, exact top-k
    attention). ``selector``: the paged cache's page selector (registry name). ``budgeted``:
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
    cache: str
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
    Method("full", "the whole KV cache, transformers' own (the reference)", "sdpa", budgeted=False),
    Method("dense", "the whole KV cache, growing in place (no per-step copy)", "dense", budgeted=False),
    Method("ice", "IceCache: budget pages chosen by the DCI-tree, the rest on the host", "paged",
           selector="dci", sparse_prefill=True, short_dense=True),
    Method("ice-reuse", "ice where only every --reuse-every-th layer queries its index", "paged",
           selector="dci", sparse_prefill=True, reuse=True, short_dense=True),
    Method("oracle", "upper bound: exact top tokens per KV head over the dense cache", "oracle"),
    Method("oracle-qhead", "upper bound: exact top tokens per query head (G x the memory)", "oracle",
           oracle_per="query"),
    Method("streaming", "StreamingLLM: sink and window pages only", "paged", selector="streaming",
           budgeted=False, sparse_prefill=True),
    Method("quest", "Quest: token-order pages ranked by per-channel key bounds", "paged",
           selector="quest", sparse_prefill=True),
    Method("snapkv", "SnapKV: the prompt's last queries choose the tokens once", "paged",
           selector="snapkv"),
    Method("arkvale", "ArkVale: token-order pages by box digests; evicted pages recalled", "paged",
           selector="arkvale", sparse_prefill=True),
    Method("h2o", "H2O: keep the tokens with the most accumulated attention (evicts for good)", "paged",
           selector="h2o"),
    Method("omnikv", "OmniKV: filter layers' exact top tokens, reused by the layers up to the next", "paged",
           selector="omnikv", reuse=True, anchor_depths=OMNIKV_FILTERS),
    Method("pqcache", "PQCache: top tokens by product-quantized key scores", "paged", selector="pqcache"),
    Method("magicpig", "MagicPIG: LSH-sampled keys, attention by importance sampling", "paged",
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
    from .cache.selectors import SELECTORS

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


def ice_spec(settings: Settings, method: Method):
    """The paged cache's spec for ``method`` under ``settings`` (budget in pages from here on)."""
    from .cache import IceSpec
    from .config import selector_settings

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
    )


def host_dtype(settings: Settings) -> str | None:
    """The host store's dtype (None: the KV's own). ``auto`` keeps a float32 model's offloaded
    keys and values in float16 (as llama.cpp's KV cache does by default): half the host memory,
    which a 250k-token context on a 24 GiB machine needs."""
    if settings.host_dtype == "auto":
        return "float16" if settings.dtype == "float32" else None
    return None if settings.host_dtype == settings.dtype else settings.host_dtype


def dense_kv_dtype(settings: Settings, device: Any = "cpu") -> Any:
    """The dtype dense layers hold their keys and values in while decoding (None: the model's;
    ``settings.dense_kv``). ``auto`` takes bfloat16 for a float32 model on a CPU that multiplies
    it natively (:func:`~.cache.dense.native_bf16`), where a dense step reads half the bytes."""
    return _half(settings.dense_kv, settings, device)


def prompt_half(settings: Settings, device: Any = "cpu") -> Any:
    """The dtype of the prompt's products (:func:`~.weights.prompt_products`; None: the model's;
    ``settings.prompt_compute``, ``auto`` as :func:`dense_kv_dtype`)."""
    return _half(settings.prompt_compute, settings, device)


def _half(choice: str, settings: Settings, device: Any) -> Any:
    import torch

    if choice == "model" or settings.dtype == "bfloat16":
        return None
    if choice == "auto":
        from .cache.dense import native_bf16

        if torch.device(device).type != "cpu" or settings.dtype != "float32" or not native_bf16():
            return None
    return torch.bfloat16


def attention_name(method: Method) -> str:
    """Register (once) and return the attention implementation ``method`` runs with."""
    if method.cache == "sdpa":
        return "sdpa"
    from .cache import attention

    return attention.register(method.cache)


def prepare_model(method: str, model: Any, settings: Settings | None = None, tokens: int = 0) -> None:
    """Select the attention implementation ``method`` needs and, with ``settings``, the RoPE of a
    run of ``tokens`` (prompt + generation; ``rope_scaling``): the model is shared by runs."""
    name = attention_name(get(method))
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
    if settings is not None:
        set_rope(model, settings, tokens)


def set_rope(model: Any, settings: Settings, tokens: int) -> None:
    """The model's RoPE for a run of ``tokens`` under ``settings.rope_scaling`` (:mod:`.rope`)."""
    from . import rope

    try:
        rope.apply(model, settings.rope_scaling, tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def positions(method: str, model: Any, settings: Settings, tokens: int) -> str:
    """``true`` or ``remap``: how a run of ``tokens`` (prompt + generation) under ``method`` sets
    RoPE positions (``settings.positions``; only the paged methods can remap)."""
    from .cache.positions import RopeFrame, choose

    if get(method).cache != "paged" or settings.rope_scaling != "none":
        if settings.positions == "remap":
            raise UsageError(f"positions: remap works with the paged methods, not '{method}'")
        return "true"  # (a RoPE scaling handles long runs in its own way)
    try:
        return choose(settings.positions, RopeFrame.from_model(model), tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def full_prefill_bytes(model: Any, settings: Settings, tokens: int) -> int:
    """Memory a full-attention prefill of ``tokens`` holds at its peak: the whole prompt's keys
    and values, in the model's dtype, plus one chunk's attention scores (float32)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[settings.dtype]
    kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * size * tokens
    scores = 4 * heads * min(tokens, settings.chunk_size) * tokens
    return kv + scores


def prefill_mode(method: str, model: Any, settings: Settings, prompt_tokens: int) -> str:
    """``full`` or ``sparse`` for a prompt of ``prompt_tokens`` (``settings.prefill``; ``auto``:
    full attention while the prompt fits the model's trained context and half the profile's
    memory, sparse beyond, for the methods that can)."""
    if settings.prefill != "auto":
        return settings.prefill
    if not get(method).sparse_prefill:
        return "full"
    from .cache.positions import RopeFrame

    frame = RopeFrame.from_model(model)
    trained = frame.trained if frame is not None else model.config.max_position_embeddings
    memory = settings.device_memory_gib if settings.device.startswith("cuda") else settings.host_memory_gib
    fits = not memory or full_prefill_bytes(model, settings, prompt_tokens) <= memory * 2**30 / 2
    return "full" if prompt_tokens <= trained and fits else "sparse"


def plan_run(method: str, model: Any, settings: Settings, prompt_tokens: int, new_tokens: int) -> Settings:
    """``settings`` with the prefill mode and positions decided for one run (no ``auto`` left);
    the model's RoPE set for it (``rope_scaling``)."""
    set_rope(model, settings, prompt_tokens + new_tokens)
    return settings.replace(prefill=prefill_mode(method, model, settings, prompt_tokens),
                            positions=positions(method, model, settings, prompt_tokens + new_tokens))


def all_dense(method: str, model: Any, settings: Settings, tokens: int, prompt_tokens: int | None = None) -> bool:
    """Whether a run of ``tokens`` (prompt + generation) under ``method`` keeps every layer dense
    (:func:`dense_plan`)."""
    return dense_plan(method, model, settings, tokens, prompt_tokens)[0]


def dense_plan(method: str, model: Any, settings: Settings, tokens: int,
               prompt_tokens: int | None = None) -> tuple[bool, Any]:
    """(every layer dense, the RoPE frame its decode steps clamp by or None) for a run of
    ``tokens`` (prompt + generation) under ``method``.

    Every layer is dense when the method allows it (``short_dense``: ice, ice-reuse), ``tokens``
    is at most ``dense_until``, and the prefill is not sparse. On the CPU, attending to every
    token of a few thousand is faster than choosing pages (docs/results.md, "Decode speed").
    With true positions that is exact. With remapped positions (the run goes past the trained
    context) only when the prompt (``prompt_tokens``; unknown: no) fits the trained context: the
    prompt is then computed at its true positions, and decode steps clamp the distances past the
    trained context (:func:`dense_clamp`). The baselines never do: they are run to be compared."""
    m = get(method)
    if not (m.short_dense and 0 < tokens <= settings.dense_until) or settings.prefill == "sparse":
        return False, None
    prompt = tokens if prompt_tokens is None else prompt_tokens
    if settings.prefill == "auto" and prefill_mode(method, model, settings, prompt) != "full":
        return False, None
    if positions(method, model, settings, tokens) == "true":
        return True, None
    clamp = dense_clamp(model, tokens, prompt_tokens)
    return clamp is not None, clamp


def dense_clamp(model: Any, tokens: int, prompt_tokens: int | None) -> Any:
    """The RoPE frame by which an all-dense run of ``tokens`` whose prompt is ``prompt_tokens``
    clamps its decode steps' distances (:class:`~icecache.cache.dense.GrowingLayer`), or None
    when it needs none (within the trained context) or cannot (the prompt itself goes past it,
    or the model's RoPE does not compose)."""
    from .cache.positions import RopeFrame

    frame = RopeFrame.from_model(model)
    if frame is None or not frame.composable or prompt_tokens is None:
        return None
    return frame if prompt_tokens <= frame.trained < tokens else None


def make_cache(method: str, model: Any, settings: Settings, tokens: int = 0,
               prompt_tokens: int | None = None) -> Any:
    """A fresh cache object for one sequence of about ``tokens`` tokens (prompt + generation;
    it decides ``positions: auto``), ``prompt_tokens`` of them the prompt (unknown: None),
    under ``method``."""
    m = get(method)
    check_prefill(method, settings)
    prepare_model(method, model, settings, tokens)
    from .cache.window import window_sizes

    layers = model.config.num_hidden_layers
    windows = window_sizes(model.config, layers)  # the model's sliding-window layers keep their window only
    if m.cache == "paged":
        from .cache import IceCache
        from .cache.positions import Remap, RopeFrame

        spec = ice_spec(settings, m)
        remap = None
        dense, clamp = dense_plan(method, model, settings, tokens, prompt_tokens)
        if not dense and positions(method, model, settings, tokens) == "remap":
            remap = Remap(RopeFrame.from_model(model), page_distance=spec.window_slack,
                          pin_gap=settings.remap_pin_gap)
        return IceCache(layers, spec, dense_layers=layers if dense else settings.dense_layers,
                        reuse_every=(m.reuse_every or settings.reuse_every) if m.reuse else 1,
                        device=model.device, clamp=clamp,
                        remap=remap, dense_kv=dense_kv_dtype(settings, model.device),
                        anchors=anchor_layers(m, layers, settings.dense_layers) if m.reuse else None,
                        windows=windows)
    positions(method, model, settings, tokens)  # an explicit remap is an error here
    if m.cache == "oracle":
        from .cache import OracleCache, OracleSpec

        page = settings.page_size
        return OracleCache(layers, OracleSpec(budget=settings.budget, sink=settings.sink_pages * page,
                                              window=settings.window_pages * page,
                                              dense_layers=settings.dense_layers, per=m.oracle_per), windows)
    if m.cache == "dense":
        from .cache import DenseCache

        return DenseCache(layers, dense_kv_dtype(settings, model.device), windows)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)
