"""Cache kinds: how a method holds its sequence's keys and values.

A :class:`CacheKind` provides what the rest of the code asks of a kind: the attention function
the model runs with (:meth:`~CacheKind.attention`), a fresh cache for one sequence
(:meth:`~CacheKind.make`), the memory it takes (:meth:`~CacheKind.memory`), whether it can
place RoPE positions itself (:attr:`~CacheKind.remaps`) and whether a sparse prefill's state can
be saved to the document cache (:attr:`~CacheKind.saves_state`). A method
record (:mod:`.registry`) names one of the four instances below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVSizes:
    """Sizes a memory estimate is made of, in bytes: ``layer`` (one layer's keys and values for
    the run's tokens), ``grown`` (the same in a growing buffer, with its spare capacity),
    ``windowed`` (every sliding-window layer's window), ``per_token`` (one layer's keys and
    values per token), ``global_layers`` / ``dense_global`` (layers without a window, and how
    many of them are the first ``dense_layers``), ``heads`` / ``head_dim`` (KV heads)."""

    layer: int
    grown: int
    windowed: int
    per_token: int
    global_layers: int
    dense_global: int
    heads: int
    head_dim: int
    tokens: int


class CacheKind:
    """One way of holding the KV cache (see the module's docstring)."""

    name = ""
    remaps = False  # can give attended tokens remapped RoPE positions (cache/positions.py)
    saves_state = False  # a sparse prefill's whole cache state can go to the document cache

    def attention(self, model: Any) -> str:
        """Register (once) and return the attention implementation ``model`` runs with under this
        kind. A model that caps its attention scores (Gemma 2's ``attn_logit_softcapping``) runs
        too: transformers hands the cap to the attention (``softcap``), which applies it."""
        from ..cache import attention

        return attention.register(self.name)

    def make(self, method: Any, model: Any, settings: Any, tokens: int, prompt_tokens: int | None,
             windows: list[int]) -> Any:
        """A fresh cache for one sequence of about ``tokens`` tokens under ``method``."""
        raise NotImplementedError

    def memory(self, method: Any, sizes: KVSizes, settings: Any) -> tuple[int, int]:
        """(bytes with the model, bytes on the host) the cache takes (an estimate)."""
        raise NotImplementedError


class SdpaKind(CacheKind):
    """transformers' own ``DynamicCache`` and SDPA attention (the reference a user knows)."""

    name = "sdpa"

    def attention(self, model: Any) -> str:
        # transformers' own attention: SDPA, or its eager attention where the model has no SDPA
        # path (Gemma 2: SDPA cannot cap scores)
        return "sdpa" if type(model)._supports_sdpa else "eager"

    def make(self, method, model, settings, tokens, prompt_tokens, windows):
        from transformers import DynamicCache

        return DynamicCache(config=model.config)

    def memory(self, method, sizes, settings):
        # torch.cat at each new step: the old and the new tensor of one layer at once
        return sizes.global_layers * sizes.layer + sizes.layer + sizes.windowed, 0


class OffloadedKind(SdpaKind):
    """transformers' ``DynamicCache`` with its offloading on a GPU: every layer's keys and values
    in host memory, each layer brought to the device for its attention (the next one prefetched
    meanwhile) and sent back after; the peer a user would try when the KV cache does not fit the
    card. On a CPU there is nothing to offload to: the same cache as ``full``."""

    name = "offloaded"

    def make(self, method, model, settings, tokens, prompt_tokens, windows):
        from transformers import DynamicCache

        return DynamicCache(config=model.config, offloading=model.device.type == "cuda")

    def memory(self, method, sizes, settings):
        # on the device: the layer attending, the next one prefetched and the concatenated copy
        return 3 * sizes.layer + sizes.windowed, sizes.global_layers * sizes.layer


class DenseKind(CacheKind):
    """The project's dense layers, growing in place (no per-step copy)."""

    name = "dense"

    def make(self, method, model, settings, tokens, prompt_tokens, windows):
        from ..cache import DenseCache
        from .planner import dense_kv_dtype

        return DenseCache(model.config.num_hidden_layers, dense_kv_dtype(settings, model.device), windows)

    def memory(self, method, sizes, settings):
        # spare capacity, and one layer copied when it grows
        return sizes.global_layers * sizes.grown + sizes.layer + sizes.windowed, 0


class OracleKind(DenseKind):
    """Dense layers whose attention keeps the exact top tokens (an upper bound, not a method)."""

    name = "oracle"

    def make(self, method, model, settings, tokens, prompt_tokens, windows):
        from ..cache import OracleCache, OracleSpec

        page = settings.page_size
        spec = OracleSpec(budget=settings.budget, sink=settings.sink_pages * page,
                          window=settings.window_pages * page, dense_layers=settings.dense_layers,
                          per=method.oracle_per)
        return OracleCache(model.config.num_hidden_layers, spec, windows)

    def memory(self, method, sizes, settings):
        device, host = super().memory(method, sizes, settings)
        return device + (sizes.layer if method.oracle_per == "query" else 0), host  # per query head scores


class PagedKind(CacheKind):
    """:class:`~icecache.cache.IceCache`: resident pages chosen per step by a page selector,
    the rest in a host store."""

    name = "paged"
    remaps = True
    saves_state = True

    def make(self, method, model, settings, tokens, prompt_tokens, windows):
        from ..cache import IceCache
        from ..cache.positions import Remap, RopeFrame
        from .factory import ice_spec, walk_dims
        from .planner import dense_kv_dtype, dense_plan, positions
        from .registry import anchor_layers

        layers = model.config.num_hidden_layers
        spec = ice_spec(settings, method, getattr(model.config, "attn_logit_softcapping", None),
                        walk_dims(model.config, settings))
        remap = None
        dense, clamp = dense_plan(method.name, model, settings, tokens, prompt_tokens)
        if not dense and positions(method.name, model, settings, tokens) == "remap":
            frame = RopeFrame.from_model(model)
            # beyond the largest sliding window, while that leaves half the trained context
            remap = Remap(frame, page_distance=min(max(windows, default=0), frame.trained // 2),
                          pin_gap=settings.remap_pin_gap)
        return IceCache(layers, spec, dense_layers=layers if dense else settings.dense_layers,
                        reuse_every=(method.reuse_every or settings.reuse_every) if method.reuse else 1,
                        device=model.device, clamp=clamp,
                        remap=remap, dense_kv=dense_kv_dtype(settings, model.device),
                        anchors=anchor_layers(method, layers, settings.dense_layers) if method.reuse else None,
                        windows=windows)

    def memory(self, method, sizes, settings):
        from ..memory import DTYPE_BYTES, INDEX_BYTES_PER_KEY, INDEX_INT8_BYTES_PER_KEY, QUEST_BYTES_PER_KEY
        from .planner import host_dtype

        sparse = sizes.global_layers - sizes.dense_global
        sparse_prefill = settings.prefill == "sparse"
        resident = (settings.sink_pages + settings.window_pages + 1) * settings.page_size + max(
            settings.budget if method.budgeted else 0, settings.prefill_budget if sparse_prefill else 0)
        pools = sparse * sizes.per_token * (resident + (settings.chunk_size if sparse_prefill else 0))
        device = sizes.dense_global * sizes.grown + pools + sizes.windowed
        host_item = DTYPE_BYTES[host_dtype(settings) or settings.dtype]
        host = sparse * 2 * sizes.heads * sizes.head_dim * host_item * sizes.tokens
        per_key = {"dci": INDEX_BYTES_PER_KEY, "quest": QUEST_BYTES_PER_KEY}.get(method.selector or "", 0)
        if method.selector == "dci" and settings.tuned("index_walk_keys") == "int8":
            per_key += INDEX_INT8_BYTES_PER_KEY
        host += sparse * sizes.heads * per_key * sizes.tokens
        return device, host


SDPA, OFFLOADED, DENSE, ORACLE, PAGED = SdpaKind(), OffloadedKind(), DenseKind(), OracleKind(), PagedKind()
