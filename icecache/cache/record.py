"""A prefill that several methods share: SDPA attention that also keeps the prompt-end queries.

Every method in this project prefills with full attention, so one dense prefill can seed them
all (``Session.adopt``). The one thing a method reads from the prefill besides keys and values is
SnapKV's observation window (the last queries of the prompt, per layer), and H2O's grid of the
prompt's queries (:class:`~.selectors.tokens.QueryGrid`); this attention records them while
computing ordinary SDPA attention.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .chunked import sdpa_forward


class _Recording(threading.local):
    """This thread's recording (each thread starts with none)."""

    def __init__(self):
        self.observation = 0  # prompt-end queries kept per layer (0: not recording)
        self.queries: dict[int, torch.Tensor] = {}
        self.grids: dict = {}


_state = _Recording()


def start(observation: int) -> None:
    _state.observation = observation
    _state.queries = {}
    _state.grids = {}


def recorded() -> dict[int, torch.Tensor]:
    """Layer index -> (query heads, up to ``observation``, head_dim) of the last prompt tokens."""
    return _state.queries


def grids() -> dict:
    """Layer index -> :class:`~.selectors.tokens.QueryGrid` of the prompt's queries."""
    return _state.grids


def record_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    w = _state.observation
    if w:
        i = module.layer_idx
        tail = query[0, :, -w:].detach()
        prev = _state.queries.get(i)
        if prev is not None and tail.shape[1] < w:  # a short last chunk: keep the earlier queries
            tail = torch.cat([prev, tail], dim=1)[:, -w:]
        _state.queries[i] = tail.clone()
        grid = _state.grids.get(i)
        if grid is None:
            from .selectors.h2o import PROMPT_QUERIES
            from .selectors.tokens import QueryGrid

            grid = _state.grids[i] = QueryGrid(PROMPT_QUERIES, w)
        end = key.shape[2]  # the chunk's queries are the last of the keys' positions
        grid.add(query[0].detach(), np.arange(end - query.shape[2], end))
    return sdpa_forward(module, query, key, value, attention_mask, scaling=scaling,
                        dropout=dropout, **kwargs)


def register() -> str:
    from .attention import register as register_kind

    return register_kind("record")
