"""Quest as a selector: pages are runs of ``page_size`` consecutive tokens, and a page's score for
a query is the upper bound ``sum_i max(q_i min_i, q_i max_i)`` from per-channel key minima and
maxima; the group's query heads' page ranks are merged rank by rank."""

from __future__ import annotations

import numpy as np

from ...index.select import merge_group_pages
from .base import HeadIndexes, register


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


@register("quest")
class QuestSelector(HeadIndexes):
    def new_index(self, head: int, capacity: int) -> QuestIndex:
        return QuestIndex(self.head_dim, self.spec.page_size, capacity)
