"""The IceCache KV-cache manager inside transformers.

:class:`IceCache` is a transformers ``Cache`` whose first ``dense_layers`` layers are ordinary
dense layers (:class:`~.dense.GrowingLayer`), whose sliding-window layers (a model's own, such as
Gemma 3's) keep their window only (:class:`~.window.WindowLayer`), and whose other layers are
:class:`~.ice_layer.IceLayer`: sink and window resident, the rest of the keys and values in a host
store, indexed by a page selector, and at each decode step the selected pages loaded into a
fixed-size pool. ``ice-reuse``: every ``reuse_every``-th sparse layer is an anchor that selects;
the layers after it reuse its selection; or ``anchors`` names the anchor layers (OmniKV's filter
layers), each serving the layers up to the next one.

Device-resident bytes per ice layer: (sink + window + page + budget) tokens x KV heads x
head_dim x 2 (keys and values) x dtype size, whatever the context length.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers.cache_utils import Cache

from . import current
from .backend import TorchBackend
from .dense import GrowingLayer
from .ice_layer import IceLayer
from .positions import Remap, RemapDenseLayer
from .spans import SpanVotes
from .spec import IceSpec, StepStats
from .window import WindowLayer, kv_in_order


class IceCache(Cache):
    def __init__(self, num_layers: int, spec: IceSpec, dense_layers: int = 2,
                 reuse_every: int = 1, device: torch.device | str = "cpu", remap: Remap | None = None,
                 anchors: frozenset[int] | None = None, dense_kv: torch.dtype | None = None,
                 clamp=None, windows: list[int] | None = None):
        self.spec = spec
        self.remap = remap  # positions remapped (positions.py); None: true positions
        self.backend = TorchBackend(device, spec.attention_backend)
        self.stats = StepStats()
        votes = SpanVotes(spec.answer_spans, spec.page_size) if spec.span_pages else None
        layers: list = []
        anchor = None
        for i in range(num_layers):
            if windows and windows[i]:  # a sliding-window layer: its window only, at any length
                layers.append(WindowLayer(windows[i]))
                continue
            if i < dense_layers:
                layers.append(GrowingLayer(dense_kv, clamp) if remap is None else
                              RemapDenseLayer(remap, spec.sink_tokens, spec.dense_window))
                continue
            if anchors is not None:
                follows = i not in anchors and anchor is not None
            else:
                follows = reuse_every > 1 and (i - dense_layers) % reuse_every
            if follows:
                layers.append(IceLayer(i, spec, self.backend, self.stats, anchor=anchor, remap=remap,
                                       votes=votes))
            else:
                anchor = IceLayer(i, spec, self.backend, self.stats, remap=remap, votes=votes)
                layers.append(anchor)
        super().__init__(layers=layers)
        # a step is counted at the first ice layer's update (the dense and window layers before it
        # may run whole in the fused step, without an update: fused_step.run_split)
        self.first_sparse = next((i for i, layer in enumerate(layers) if isinstance(layer, IceLayer)), -1)
        # every layer dense (a short run, methods.all_dense): exact attention, no pages
        self.all_dense = dense_layers >= num_layers
        # the dense layers' distances past the trained context clamped (GrowingLayer.clamp)
        self.clamped = clamp is not None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        current.set_current(self)
        if layer_idx == self.first_sparse and key_states.shape[2] == 1:
            self.stats.steps += 1
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def ice_layers(self) -> list[IceLayer]:
        return [layer for layer in self.layers if isinstance(layer, IceLayer)]

    # -- prefill ----------------------------------------------------------------------------------
    def begin_prefill(self, tokens: int, tail: int = 0) -> None:
        """The next ``tokens`` prompt tokens come in chunks: a layer whose last chunk has passed
        can go to the host store and its index while the next layers compute. The ``tail``
        prompt tokens after them come one at a time (a sparse prefill's tail): they select
        ``tail_pages`` pages, whatever the decode budget."""
        for layer in self.ice_layers():
            layer.prompt_tokens = layer.length + tokens
            layer.tail_end = layer.prompt_tokens + tail
            layer.answer_at = layer.tail_end

    def observe(self, layer_idx: int, queries: torch.Tensor, positions=None) -> None:
        """Layer ``layer_idx``'s prompt queries (query heads, n, head_dim) at prompt
        ``positions``, from a prefill computed elsewhere (a shared dense prefill), for a selector
        that votes with them."""
        layer = self.layers[layer_idx]
        if isinstance(layer, IceLayer):
            layer.observe(queries, positions)

    def prompt_votes(self, scale: float, softcap: float | None = None) -> None:
        """``answer_spans``: every sparse layer's votes from the prompt's last queries, before the
        first generated token's step attends (:meth:`IceLayer.prompt_votes`); the passages are
        chosen from all of them at that step."""
        for layer in self.ice_layers():
            layer.prompt_votes(scale, softcap)

    def end_prefill(self) -> None:
        """Every layer offloaded and indexed (the prefill's wall time includes its index)."""
        for layer in self.ice_layers():
            layer.offload_prompt()
        self.stats.reset_step_counters()

    def forked(self, budget_pages: int) -> IceCache:
        """A deep copy of this prefilled cache that decodes with ``budget_pages`` pages per head.

        Exact (the copy decodes as a cache prefilled with that budget would) when the budget did
        not shape the prefill: the prompt is offloaded, nothing was decoded yet, the prefill's
        pool size is the same under both budgets, and no selector's index holds a choice made for
        one budget (SnapKV's votes). ``ValueError`` otherwise.
        """
        spec = dataclasses.replace(self.spec, budget_pages=budget_pages)
        layers = self.ice_layers()
        if spec.pool_pages != self.spec.pool_pages or 0 in (spec.budget_pages, self.spec.budget_pages):
            raise ValueError("the budget shaped the prefill (pool size); prefill again")
        if any(not layer.offloaded or not layer.prompt_tokens <= layer.length <= max(layer.prompt_tokens, layer.tail_end)
               for layer in layers):
            raise ValueError("only a prefilled cache that has not decoded can be forked")
        if any(layer.selector is not None and layer.selector.budget_in_index for layer in layers):
            raise ValueError("the page index holds a choice made for one budget; prefill again")
        twin = copy.deepcopy(self)
        twin.spec = spec
        for layer in twin.ice_layers():
            layer.rebudget(spec)
        return twin

    # -- what it holds ----------------------------------------------------------------------------
    def dense_kv(self, device: torch.device | str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values (1, H, T, d) in token order, at their true positions
        (copies for ice layers and remapped dense layers), on ``device`` (None: where each layer
        keeps them). Layer by layer: on the host, a GPU never holds more than one layer's copy."""
        out = []
        for layer in self.layers:
            if isinstance(layer, IceLayer):
                kv = layer.dense_kv(device)
            else:
                kv = layer.dense_kv() if isinstance(layer, RemapDenseLayer) else kv_in_order(layer)
            out.append(kv if device is None else (kv[0].to(device), kv[1].to(device)))
        return out

    def release_indexes(self) -> None:
        """Drop every layer's index (to rebuild the dense KV from the stores in less memory)."""
        for layer in self.ice_layers():
            layer.release_index()

    def device_kv_bytes(self) -> int:
        dense = sum(layer.device_bytes() for layer in self.layers if isinstance(layer, (GrowingLayer, WindowLayer)))
        return dense + sum(layer.device_bytes() for layer in self.ice_layers())

    def host_kv_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.ice_layers())

    def pool_occupancy(self) -> float:
        """Share of the decode page pools' slots holding a page (0 before the first step)."""
        used = total = 0
        for layer in self.ice_layers():
            if layer.offloaded and layer.resident is not None:
                u, t = layer.resident.slots_used()
                used, total = used + u, total + t
        return used / total if total else 0.0
