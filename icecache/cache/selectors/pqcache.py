"""PQCache as a selector: product quantization of the keys, approximate scores from the codes.

At the prompt's offload each KV head's keys are cut into ``SUBSPACES`` sub-vectors and each
sub-space gets a codebook of ``2**BITS`` centroids by k-means (Lloyd, seeded from distinct keys);
every key is stored as its centroid ids. A decode step scores all tokens from the codes (one
lookup table of query x centroid products per sub-space) and fetches the top ``budget`` tokens
from the host. Keys offloaded later are encoded with the same codebooks.

Where this differs from the paper's: the codebooks are trained on the CPU at the offload (the
paper overlaps it with the prefill on the CPU while the GPU computes); the group's query heads
rank tokens by their summed softmax weights over the approximate scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import register
from .token_base import TokenSelector
from .tokens import top_tokens

SUBSPACES = 8
BITS = 6
KMEANS_ITERS = 8


def kmeans(x: np.ndarray, k: int, iters: int = KMEANS_ITERS, seed: int = 0) -> np.ndarray:
    """Centroids (k, d) of rows ``x`` by Lloyd's algorithm from ``k`` distinct random rows (an
    empty cluster keeps its centroid). k is cut to the number of rows."""
    rng = np.random.default_rng(seed)
    k = min(k, len(x))
    c = x[rng.choice(len(x), k, replace=False)].copy()
    for _ in range(iters):
        labels = nearest(x, c)
        sums = np.zeros_like(c, dtype=np.float64)
        np.add.at(sums, labels, x)
        counts = np.bincount(labels, minlength=k)
        full = counts > 0
        c[full] = (sums[full] / counts[full, None]).astype(np.float32)
    return c


def nearest(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid (squared Euclidean) of each row of ``x``."""
    d2 = (c * c).sum(1)[None, :] - 2.0 * (x @ c.T)
    return np.argmin(d2, axis=1)


class PQCodes:
    """One KV head's codebooks (SUBSPACES, k, d / SUBSPACES) and codes (n, SUBSPACES)."""

    def __init__(self, keys: np.ndarray, subspaces: int = SUBSPACES, bits: int = BITS, seed: int = 0):
        n, d = keys.shape
        if d % subspaces:
            raise ValueError(f"head_dim {d} is not a multiple of {subspaces} sub-spaces")
        self.m, self.w = subspaces, d // subspaces
        self.books = [kmeans(np.ascontiguousarray(keys[:, s * self.w : (s + 1) * self.w]), 2 ** bits,
                             seed=seed + s) for s in range(subspaces)] if n else []
        self.codes = np.zeros((max(16, 2 * n), subspaces), np.uint16)
        self.n = 0
        self.add(keys)

    def encode(self, keys: np.ndarray) -> np.ndarray:
        out = np.empty((len(keys), self.m), np.uint16)
        for s, book in enumerate(self.books):
            out[:, s] = nearest(np.ascontiguousarray(keys[:, s * self.w : (s + 1) * self.w]), book)
        return out

    def add(self, keys: np.ndarray) -> None:
        if not len(keys) or not self.books:
            return
        if self.n + len(keys) > len(self.codes):
            grown = np.zeros((max(self.n + len(keys), 2 * len(self.codes)), self.m), np.uint16)
            grown[: self.n] = self.codes[: self.n]
            self.codes = grown
        self.codes[self.n : self.n + len(keys)] = self.encode(keys)
        self.n += len(keys)

    def scores(self, queries: np.ndarray) -> np.ndarray:
        """Approximate inner products (G, n) of queries (G, d) with every coded key."""
        out = np.zeros((len(queries), self.n), np.float32)
        codes = self.codes[: self.n]
        for s, book in enumerate(self.books):
            table = queries[:, s * self.w : (s + 1) * self.w] @ book.T  # (G, k)
            out += table[:, codes[:, s]]
        return out


@dataclass(frozen=True)
class PQSettings:
    """PQCache's codes: ``pq_subspaces`` sub-vectors per key, ``2**pq_bits`` centroids each."""

    pq_subspaces: int = SUBSPACES
    pq_bits: int = BITS

    def __post_init__(self):
        if self.pq_subspaces < 1 or not 1 <= self.pq_bits <= 12:
            raise ValueError("pq_subspaces must be >= 1 and pq_bits from 1 to 12")


@register("pqcache")
class PQCacheSelector(TokenSelector):
    Settings = PQSettings

    def codes(self, keys: np.ndarray, head: int) -> PQCodes:
        return PQCodes(keys, self.settings.pq_subspaces, self.settings.pq_bits, seed=head)

    def prepared(self, prompt_keys, lo: int, hi: int, mid: np.ndarray) -> None:
        self.pq = [self.codes(mid[h], h) for h in range(mid.shape[0])]

    def added(self, head: int, ids: np.ndarray, keys: np.ndarray) -> None:
        pq = self.pq[head]
        if not pq.books:  # nothing was offloaded at the prompt: train on what arrives first
            self.pq[head] = self.codes(self.keys[head].all(), head)
        else:
            pq.add(keys)

    def choose(self, head: int, queries: np.ndarray, take: int) -> np.ndarray:
        s = self.pq[head].scores(queries) * self.scale
        if self.spec.softcap:  # the model's cap on its scores
            s = self.spec.softcap * np.tanh(s / self.spec.softcap)
        s -= s.max(axis=1, keepdims=True)
        e = np.exp(s)
        weights = (e / e.sum(axis=1, keepdims=True)).sum(axis=0)
        return top_tokens(weights, take)

    def release(self) -> None:
        super().release()
        self.pq = []
