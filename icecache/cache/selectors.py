"""Page indexes the paged cache can select with, all behind one protocol.

An index holds one KV head's middle tokens (host-store rows 0..n-1, in token order) in pages and
offers what the cache needs:

- ``insert(keys) -> dirty pages`` (a page whose members changed must be reloaded),
- ``members`` (pages x page_size, row ids) and ``count`` (fill per page), ``npages``,
- ``select_group(queries, k, max_pages) -> pages``: the ranked pages for a GQA group's queries.

:class:`~icecache.index.DCITree` is the IceCache index. :class:`QuestIndex` is Quest: pages are
runs of ``page_size`` consecutive tokens, and a page's score for a query is the upper bound
``sum_i max(q_i min_i, q_i max_i)`` from per-channel key minima and maxima.
"""

from __future__ import annotations

import numpy as np

from ..index.select import merge_group_pages


class QuestIndex:
    def __init__(self, head_dim: int, page_size: int, capacity: int = 1024):
        self.d, self.S = head_dim, page_size
        self.n = 0
        self.npages = 0
        cap = max(4, (capacity + page_size - 1) // page_size)
        self.members = np.full((cap, page_size), -1, np.int32)
        self.count = np.zeros(cap, np.int32)
        self.lo = np.zeros((cap, head_dim), np.float32)
        self.hi = np.zeros((cap, head_dim), np.float32)

    def _grow(self, pages: int) -> None:
        cap = self.members.shape[0]
        if pages <= cap:
            return
        while cap < pages:
            cap *= 2
        for name, fill in (("members", -1), ("count", 0), ("lo", 0), ("hi", 0)):
            old = getattr(self, name)
            new = np.full((cap, *old.shape[1:]), fill, old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def insert(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.float32)
        m = keys.shape[0]
        if m == 0:
            return np.empty(0, np.int32)
        first = self.n // self.S
        last = (self.n + m - 1) // self.S
        self._grow(last + 1)
        for t in range(m):
            i = self.n + t
            p, s = divmod(i, self.S)
            if s == 0:
                self.lo[p] = keys[t]
                self.hi[p] = keys[t]
            else:
                np.minimum(self.lo[p], keys[t], out=self.lo[p])
                np.maximum(self.hi[p], keys[t], out=self.hi[p])
            self.members[p, s] = i
            self.count[p] = s + 1
        self.n += m
        self.npages = last + 1
        return np.arange(first, last + 1, dtype=np.int32)

    def page_scores(self, q: np.ndarray) -> np.ndarray:
        lo, hi = self.lo[: self.npages], self.hi[: self.npages]
        return np.maximum(lo * q, hi * q).sum(1)

    def select_group(self, queries: np.ndarray, k: int, max_pages: int) -> np.ndarray:
        if self.npages == 0:
            return np.empty(0, np.int32)
        lists = []
        for q in np.atleast_2d(queries):
            s = self.page_scores(q)
            take = min(max_pages, len(s))
            top = np.argpartition(-s, take - 1)[:take]
            lists.append(top[np.argsort(-s[top], kind="stable")].astype(np.int32))
        return merge_group_pages(lists, max_pages)


class SnapIndex:
    """SnapKV: the prompt's observation window votes once; the chosen tokens stay selected.

    ``votes`` (one per middle token) are the observation queries' attention weights summed over
    the window and smoothed by a width-``pool`` average; the top ``budget`` tokens, in token order,
    are cut into pages. Tokens inserted later (the window's aged pages) are stored but never
    selected: SnapKV compresses the prompt once, at prefill.
    """

    def __init__(self, page_size: int, budget: int, votes: np.ndarray, pool: int = 7):
        self.S = page_size
        self.budget = budget
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


def snap_votes(obs_q, keys, sink: int, mid: int, scale: float):
    """Per KV head, the observation queries' summed softmax weights on the middle tokens.

    ``obs_q`` (Hq, W, d) the prompt's last queries; ``keys`` (H, T, d) all prompt keys. Returns
    (H, mid) float64.
    """
    import torch

    H = keys.shape[0]
    G = obs_q.shape[0] // H
    out = np.zeros((H, mid))
    for h in range(H):
        q = obs_q[h * G : (h + 1) * G].reshape(-1, obs_q.shape[-1]).float()
        w = torch.softmax(q @ keys[h].float().T * scale, dim=-1)
        out[h] = w[:, sink : sink + mid].sum(0).double().numpy()
    return out
