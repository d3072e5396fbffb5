"""The run planner: what one run of a method does on this model and machine, decided before
its cache is made (prefill mode, RoPE positions, every layer dense or not, the dtypes its dense
layers and host store use)."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import UsageError
from .registry import get


def host_dtype(settings: Settings) -> str | None:
    """The host store's dtype (None: the KV's own). ``auto`` keeps a float32 model's offloaded
    keys and values in float16 (as llama.cpp's KV cache does by default): half the host memory,
    which a 250k-token context on a 24 GiB machine needs."""
    if settings.host_dtype == "auto":
        return "float16" if settings.dtype == "float32" else None
    return None if settings.host_dtype == settings.dtype else settings.host_dtype


def dense_kv_dtype(settings: Settings, device: Any = "cpu") -> Any:
    """The dtype dense layers hold their keys and values in while decoding (None: the model's;
    ``settings.dense_kv``). ``auto`` takes bfloat16 for a float32 model on a CPU, where a dense
    step reads half the bytes: numba's kernels widen it by a shift, so no CPU feature is needed."""
    return _half(settings.dense_kv, settings, device, native=False)


def prompt_half(settings: Settings, device: Any = "cpu") -> Any:
    """The dtype of the prompt's products (:func:`~.weights.prompt_products`; None: the model's;
    ``settings.prompt_compute``, ``auto`` as :func:`dense_kv_dtype`)."""
    return _half(settings.prompt_compute, settings, device)


def _half(choice: str, settings: Settings, device: Any, native: bool = True) -> Any:
    """bfloat16 or None for a setting of ``model``/``bfloat16``/``auto``; ``auto`` asks for a CPU
    and a float32 model, and with ``native`` a CPU that multiplies bfloat16 natively."""
    import torch

    if choice == "model" or settings.dtype == "bfloat16":
        return None
    if choice == "auto":
        from ..cache.dense import native_bf16

        if torch.device(device).type != "cpu" or settings.dtype != "float32" or (native and not native_bf16()):
            return None
    return torch.bfloat16


def prepare_model(method: str, model: Any, settings: Settings | None = None, tokens: int = 0) -> None:
    """Select the attention implementation ``method`` needs and, with ``settings``, the RoPE of a
    run of ``tokens`` (prompt + generation; ``rope_scaling``): the model is shared by runs."""
    name = get(method).cache.attention(model)
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
    if settings is not None:
        set_rope(model, settings, tokens)


def set_rope(model: Any, settings: Settings, tokens: int) -> None:
    """The model's RoPE for a run of ``tokens`` under ``settings.rope_scaling`` (:mod:`.rope`)."""
    from .. import rope

    try:
        rope.apply(model, settings.rope_scaling, tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def positions(method: str, model: Any, settings: Settings, tokens: int) -> str:
    """``true`` or ``remap``: how a run of ``tokens`` (prompt + generation) under ``method`` sets
    RoPE positions (``settings.positions``; only the paged methods can remap)."""
    from ..cache.positions import RopeFrame, choose

    if not get(method).cache.remaps or settings.rope_scaling != "none":
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
    from ..cache.positions import RopeFrame

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
    from ..cache.positions import RopeFrame

    frame = RopeFrame.from_model(model)
    if frame is None or not frame.composable or prompt_tokens is None:
        return None
    return frame if prompt_tokens <= frame.trained < tokens else None


def tail_steps(prefill: str, prefill_queries: int, tokens: int) -> int:
    """How many of a prompt's last tokens a prefill runs one at a time, as decode steps.

    In a sparse prefill a chunk's pages are chosen by a few of its positions, so the prompt's
    end (the question, the instruction, whose last position gives the first answer token) would
    see pages chosen mostly for other positions. Its last ``2 x prefill_queries`` tokens go
    through the decode step instead, each choosing its own pages (``tail_budget`` tokens of them,
    whatever the decode budget): in 32k passkey cases that the chunked tail missed, the same
    tokens as decode steps found the key (docs/results.md, "Accuracy beyond the trained
    context"). A full prefill attends to everything and needs none. At least one token is left
    to the chunks.
    """
    if prefill != "sparse":
        return 0
    return max(0, min(2 * prefill_queries, tokens - 1))
