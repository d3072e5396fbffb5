"""The attention functions registered with transformers, one per cache kind.

transformers calls an attention function with a layer's query, keys and values; these adapters
find the cache (:mod:`.current`) and hand the work to it: an ice layer's decode step is
:meth:`IceLayer.attend <icecache.cache.ice_layer.IceLayer.attend>`, a dense layer's is
:func:`~.dense.dense_attention`, the oracle's :func:`~.oracle.oracle_attention`, and the shared
dense prefill's :func:`~.record.record_attention`. Each applies the cap a model puts on its
attention scores (transformers' ``softcap`` argument: Gemma 2's ``attn_logit_softcapping``).
"""

from __future__ import annotations

import torch

from .chunked import sdpa_forward
from .current import current
from .dense import GrowingLayer, dense_attention, dense_decode, windowed_dense
from .ice import IceCache
from .ice_layer import IceLayer
from .positions import RemapDenseLayer
from .window import WindowLayer

NAME = "icecache"
_registered = False


def ice_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ice methods' attention: an offloaded ice layer's step is the layer's own
    :meth:`~.ice_layer.IceLayer.attend`; a dense layer's or a window layer's decode step
    :func:`~.dense.dense_decode`; prompt chunks go to SDPA (a sparse prefill's dense layers to
    :func:`~.dense.windowed_dense`)."""

    cache = current()
    layer = cache.layers[module.layer_idx] if isinstance(cache, IceCache) else None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")  # Gemma 2 caps its scores (None: no cap)
    if isinstance(layer, IceLayer):
        if layer.offloaded:
            if layer.awaits_prompt_votes():
                cache.prompt_votes(scale, softcap)  # a prompt that came whole: its last queries vote first
            return layer.attend(query[0], scale, softcap), None
        layer.observe(query[0])
    elif isinstance(layer, GrowingLayer):
        if isinstance(layer, RemapDenseLayer) and query.shape[2] == 1:
            return layer.attend(query, scale, softcap), None
        if layer.clamp is not None and query.shape[0] == 1 and query.shape[2] == 1 and attention_mask is None:
            return dense_decode(query, key, value, scale, clamp=layer.clamped(query), softcap=softcap), None
        if query.shape[2] > 1 and cache.spec.sparse_prefill:
            frame = cache.remap.frame if cache.remap is not None else None
            out = windowed_dense(query, key, value, cache.spec.sink_tokens, cache.spec.dense_window, scale,
                                 frame=frame, softcap=softcap)
            if out is not None:
                return out, None
        return dense_attention(module, query, key, value, attention_mask, scaling=scaling,
                               dropout=dropout, **kwargs)
    elif isinstance(layer, WindowLayer) and query.shape[0] == 1 and query.shape[2] == 1 and sees_all(attention_mask):
        return dense_decode(query, key, value, scale, softcap=softcap), None  # its whole window
    return sdpa_forward(module, query, key, value, attention_mask, scaling=scaling,
                        dropout=dropout, **kwargs)


def sees_all(mask) -> bool:
    """Whether an attention mask leaves every key visible (None: no mask)."""
    return mask is None or (mask.dtype == torch.bool and bool(mask.all()))


def register_attention(name: str, fn) -> None:
    """Register ``fn`` with transformers' ``AttentionInterface`` under ``name``, with SDPA's
    masks (without a mask function registered, transformers passes a custom attention none)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)


NAMES = {"paged": NAME, "dense": "icecache_dense", "oracle": "icecache_oracle", "record": "icecache_record"}


def _functions() -> dict:
    from .oracle import oracle_attention
    from .record import record_attention

    return {"paged": ice_attention, "dense": dense_attention, "oracle": oracle_attention,
            "record": record_attention}


def register(kind: str = "paged") -> str:
    """Register the attention of a cache kind (``paged``, ``dense``, ``oracle``, ``record``)
    with transformers, once; return its name."""
    global _registered
    if not _registered:
        for k, fn in _functions().items():
            register_attention(NAMES[k], fn)
        _registered = True
    return NAMES[kind]
