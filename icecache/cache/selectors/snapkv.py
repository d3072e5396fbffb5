"""SnapKV as a selector: the prompt's last queries (its observation window) vote once for the
middle tokens; the chosen tokens, cut into pages in token order, stay selected."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..chunked import soft_cap
from .base import HeadIndexes, register


class SnapIndex:
    """SnapKV: the prompt's observation window votes once; the chosen tokens stay selected.

    ``votes`` (one per middle token) are the observation queries' attention weights summed over
    the window and smoothed by a width-``pool`` average; the top ``budget`` tokens, in token order,
    are cut into pages. Tokens inserted later (the window's aged pages) are stored but never
    selected: SnapKV compresses the prompt once, at prefill.
    """

    def __init__(self, page_size: int, budget_pages: int, votes: np.ndarray, pool: int = 7):
        self.S = page_size
        self.budget = budget_pages * page_size
        self.votes = np.asarray(votes, np.float64)
        self.pool = pool
        self.n = 0
        self.npages = 0
        self.members = np.full((1, page_size), -1, np.int32)
        self.count = np.zeros(1, np.int32)

    def insert(self, keys: np.ndarray) -> np.ndarray:
        m = len(keys)
        first = self.n == 0
        self.n += m
        if not first or m == 0:
            return np.empty(0, np.int32)
        v = self.votes[:m]
        if self.pool > 1 and m > 1:
            kernel = np.ones(self.pool) / self.pool
            v = np.convolve(v, kernel, mode="same")
        take = min(self.budget, m)
        chosen = np.sort(np.argpartition(-v, take - 1)[:take]).astype(np.int32)
        self.npages = (take + self.S - 1) // self.S
        self.members = np.full((self.npages, self.S), -1, np.int32)
        self.count = np.zeros(self.npages, np.int32)
        for p in range(self.npages):
            part = chosen[p * self.S : (p + 1) * self.S]
            self.members[p, : len(part)] = part
            self.count[p] = len(part)
        return np.arange(self.npages, dtype=np.int32)

    def select_group(self, queries: np.ndarray, k: int, max_pages: int) -> np.ndarray:
        return np.arange(min(self.npages, max_pages), dtype=np.int32)


def snap_votes(obs_q, keys, sink: int, mid: int, scale: float, softcap: float | None = None):
    """Per KV head, the observation queries' summed softmax weights on the middle tokens
    (``softcap``: of the scores capped as the model caps them).

    ``obs_q`` (Hq, W, d) the prompt's last queries; ``keys`` (H, T, d) all prompt keys. Returns
    (H, mid) float64.
    """
    H = keys.shape[0]
    G = obs_q.shape[0] // H
    out = np.zeros((H, mid))
    for h in range(H):
        q = obs_q[h * G : (h + 1) * G].reshape(-1, obs_q.shape[-1]).float()
        w = torch.softmax(soft_cap(q @ keys[h].float().T * scale, softcap), dim=-1)
        out[h] = w[:, sink : sink + mid].sum(0).double().cpu().numpy()
    return out


@dataclass(frozen=True)
class ObservationSettings:
    """SnapKV's and H2O's: the prompt's last ``observation`` queries vote (SnapKV) or are each
    counted (H2O); the shared prefill records as many (``icecache.cache.record``)."""

    observation: int = 32

    def __post_init__(self):
        if not 1 <= self.observation <= 1024:
            raise ValueError("observation must be a whole number from 1 to 1024")


@register("snapkv")
class SnapKVSelector(HeadIndexes):
    """Keeps the prompt's last ``observation`` queries (:meth:`observe`) until the prompt
    is offloaded; those queries' votes choose the ``budget_pages`` pages of every head."""

    Settings = ObservationSettings
    budget_in_index = True  # the votes chose budget_pages pages per head at build
    waits_for_queries = True

    def __init__(self, spec):
        super().__init__(spec)
        self.queries: torch.Tensor | None = None
        self.votes: np.ndarray | None = None

    def observe(self, queries: torch.Tensor, positions=None) -> None:
        self.queries = queries[:, -self.settings.observation :].detach()

    def build(self, prompt_keys: torch.Tensor, lo: int, hi: int, capacity: int,
              middle: torch.Tensor | None = None) -> None:
        if self.queries is not None:
            self.votes = snap_votes(self.queries, prompt_keys, lo, hi - lo, prompt_keys.shape[-1] ** -0.5,
                                    self.spec.softcap)
        else:
            self.votes = np.zeros((prompt_keys.shape[0], hi - lo))
        super().build(prompt_keys, lo, hi, capacity, middle)

    def new_index(self, head: int, capacity: int) -> SnapIndex:
        return SnapIndex(self.spec.page_size, self.spec.budget_pages, self.votes[head])
