"""ArkVale as a selector: token-order pages with digests, a resident set that recalls pages.

Pages are runs of ``page_size`` consecutive offloaded tokens. A page's digest is a box per KV
head: its centre is the midpoint of the keys' per-channel minimum and maximum, its half-width the
keys' mean absolute distance from that centre (a box that hugs most of the keys rather than
bounding all of them, as ArkVale summarizes pages). A query's estimate for a page is the box's
upper bound ``sum_i max(q_i lo_i, q_i hi_i)``; a page's score is the sum over the layer's query
heads, so every KV head keeps the same pages (ArkVale's pages hold all heads).

The resident set holds up to ``budget`` pages: each step the ``budget / 2`` best-scored pages
are made resident (recalled from the host where they were evicted) and the rest of the set keeps
the best-scored of the pages already resident; the others are evicted to the host.

Where this differs from the paper's: the budget excludes the sink and window pages (ArkVale's
includes them); digests are kept on the host with the pages (ArkVale keeps them on the GPU).
"""

from __future__ import annotations

import numpy as np

from .base import register
from .token_base import TokenSelector


def digest(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) (d,) of one page's keys (m, d): centre of the min/max box -/+ the keys' mean
    absolute distance from the centre."""
    centre = (keys.max(0) + keys.min(0)) / 2
    spread = np.abs(keys - centre).mean(0)
    return centre - spread, centre + spread


@register("arkvale")
class ArkValeSelector(TokenSelector):
    def prepared(self, prompt_keys, lo: int, hi: int, mid: np.ndarray) -> None:
        H, _, d = mid.shape
        S = self.spec.page_size
        self.S = S
        self.members = np.full((16, S), -1, np.int32)
        self.count = np.zeros(16, np.int32)
        self.version = np.zeros(16, np.int64)
        self.lo = np.zeros((H, 16, d), np.float32)
        self.hi = np.zeros((H, 16, d), np.float32)
        self.n = self.npages = 0
        self.resident = np.empty(0, np.int64)
        self._append(mid.shape[1])

    def _grow(self, pages: int) -> None:
        cap = len(self.count)
        if pages <= cap:
            return
        cap = max(pages, 2 * cap)
        for name, fill in (("members", -1), ("count", 0), ("version", 0)):
            old = getattr(self, name)
            new = np.full((cap, *old.shape[1:]), fill, old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        for name in ("lo", "hi"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], cap, old.shape[2]), np.float32)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def _append(self, m: int) -> None:
        """Rows ``n .. n+m-1`` join the pages (the last page fills first); digests of the
        pages they touch are recomputed."""
        if m == 0:
            return
        S = self.S
        first, last = self.n // S, (self.n + m - 1) // S
        self._grow(last + 1)
        rows = np.arange(self.n, self.n + m)
        self.members[rows // S, rows % S] = rows
        self.n += m
        for p in range(first, last + 1):
            c = min(S, self.n - p * S)
            self.count[p] = c
            self.version[p] += 1
            for h, keys in enumerate(self.keys):
                self.lo[h, p], self.hi[h, p] = digest(keys.all()[p * S : p * S + c])
        self.npages = last + 1

    def added(self, head: int, ids: np.ndarray, keys: np.ndarray) -> None:
        if head == len(self.keys) - 1:  # every head's keys are in: the pages grow once
            self._append(len(ids))

    def page_scores(self, queries: np.ndarray) -> np.ndarray:
        """(npages,) the layer's query heads' summed upper bounds; queries (H, G, d)."""
        P = self.npages
        total = np.zeros(P, np.float64)
        for h in range(queries.shape[0]):
            lo, hi = self.lo[h, :P], self.hi[h, :P]
            for q in queries[h]:
                total += np.maximum(lo * q, hi * q).sum(1)
        return total

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        if self.npages == 0:
            return [np.empty(0, np.int32) for _ in range(queries.shape[0])]
        score = self.page_scores(np.asarray(queries, np.float32))
        order = np.argsort(-score, kind="stable")
        top = order[: max(1, max_pages // 2)]
        rest = self.resident[~np.isin(self.resident, top)]
        rest = rest[np.argsort(-score[rest], kind="stable")][: max_pages - len(top)]
        chosen = np.concatenate([top, rest])
        if len(chosen) < max_pages:  # room left in the pool: the next best pages
            extra = order[~np.isin(order, chosen)][: max_pages - len(chosen)]
            chosen = np.concatenate([chosen, extra])
        self.resident = chosen.astype(np.int64)
        return [chosen.astype(np.int32) for _ in range(queries.shape[0])]

    def page_table(self, head: int):
        return self.members, self.count, self.version

    def release(self) -> None:
        super().release()
        self.members = self.count = self.version = self.lo = self.hi = None
