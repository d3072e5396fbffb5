"""MagicPIG as a selector: locality-sensitive hashing samples the keys, and the attention is
estimated from the samples by importance sampling.

Keys are centred (the prompt's mean key subtracted: a query's scores all move by the same amount,
which softmax ignores) and hashed by SimHash: ``TABLES`` tables of ``BITS`` random hyperplanes
each, a key's code in a table the signs of its products with them. A decode step hashes each
query the same way; a key is sampled for that query when it falls in the query's bucket in at
least ``MIN_HITS`` tables. The chance of that, for a key at angle theta to the query, is
``P(theta) = P[Binomial(TABLES, (1 - theta/pi)^BITS) >= MIN_HITS]``; the attention then weighs
each sampled key by ``exp(q.k) / P`` (self-normalized importance sampling), next to the exact
sink and window. Each query head samples on its own; its KV head loads the union.

When every offloaded key fits the budget, all are attended to exactly (nothing to sample).
Where this differs from the paper's: the union is cut to ``budget`` tokens per KV head (the
tokens hit in the most tables kept), so that every method reads the same number of rows; the
hashing and sampling run on the CPU as in the paper, the weighted attention where the others'
attention runs. (BITS, TABLES) = (8, 64) is a smaller setting than the paper's (10, 150): with
head_dim 64 and thousands of keys it samples a few hundred keys per query.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import register
from .token_base import TokenSelector
from .tokens import top_tokens

BITS = 8
TABLES = 64
MIN_HITS = 2
REBUILD_EVERY = 1024  # keys hashed since the last table build that are matched by a scan


def simhash(x: np.ndarray, planes: np.ndarray) -> np.ndarray:
    """Codes (n, L) of rows ``x`` (n, d) under ``planes`` (L, K, d): bit j of table l's code
    is set when the row's product with plane (l, j) is positive."""
    signs = np.einsum("nd,lkd->nlk", x, planes) > 0
    weights = (1 << np.arange(planes.shape[1])).astype(np.int64)
    return (signs * weights).sum(axis=2).astype(np.int64)


def sample_probability(cos: np.ndarray, bits: int = BITS, tables: int = TABLES, hits: int = MIN_HITS) -> np.ndarray:
    """Chance that a key at cosine ``cos`` to the query collides in at least ``hits`` of
    ``tables`` tables of ``bits`` bits."""
    theta = np.arccos(np.clip(cos, -1.0, 1.0))
    p = (1.0 - theta / np.pi) ** bits
    miss = np.zeros_like(p)
    for j in range(hits):  # P[fewer than `hits` collisions]
        miss += _choose(tables, j) * p ** j * (1.0 - p) ** (tables - j)
    return np.clip(1.0 - miss, 1e-12, 1.0)


def _choose(n: int, k: int) -> float:
    from math import comb

    return float(comb(n, k))


class LSHTables:
    """One KV head's SimHash tables: codes of every key, and per table the keys sorted by
    bucket (rebuilt when ``REBUILD_EVERY`` keys arrived since; those are scanned)."""

    def __init__(self, planes: np.ndarray, centre: np.ndarray):
        self.planes, self.centre = planes, centre
        self.L, self.K = planes.shape[:2]
        self.codes = np.zeros((0, self.L), np.int64)
        self.built = 0
        self.order = self.starts = None

    def add(self, keys: np.ndarray) -> None:
        self.codes = np.concatenate([self.codes, simhash(keys - self.centre, self.planes)])
        if len(self.codes) - self.built >= REBUILD_EVERY or self.order is None:
            self.build()

    def build(self) -> None:
        n = len(self.codes)
        self.order = np.argsort(self.codes, axis=0, kind="stable").T.copy()  # (L, n)
        sorted_codes = np.take_along_axis(self.codes, self.order.T, axis=0).T  # (L, n)
        buckets = np.arange(1 << self.K)
        self.starts = np.stack([np.searchsorted(sorted_codes[t], buckets, side="left") for t in range(self.L)])
        self.ends = np.stack([np.searchsorted(sorted_codes[t], buckets, side="right") for t in range(self.L)])
        self.built = n

    def hits(self, query: np.ndarray) -> np.ndarray:
        """(n,) the number of tables in which each key shares the query's bucket."""
        code = simhash(query[None], self.planes)[0]
        n = len(self.codes)
        found = [self.order[t, self.starts[t, code[t]] : self.ends[t, code[t]]] for t in range(self.L)]
        count = np.bincount(np.concatenate(found), minlength=n) if found else np.zeros(n, np.int64)
        if self.built < n:  # keys since the last build: compared directly
            count[self.built :] += (self.codes[self.built :] == code[None]).sum(1)
        return count


@dataclass(frozen=True)
class LSHSettings:
    """MagicPIG's hashing: ``lsh_tables`` tables of ``lsh_bits`` hyperplanes; a key is sampled
    for a query that it meets in at least ``lsh_min_hits`` of them."""

    lsh_bits: int = BITS
    lsh_tables: int = TABLES
    lsh_min_hits: int = MIN_HITS

    def __post_init__(self):
        if not 1 <= self.lsh_bits <= 30 or self.lsh_tables < 1 or not 1 <= self.lsh_min_hits <= self.lsh_tables:
            raise ValueError("lsh_bits must be from 1 to 30, lsh_tables >= 1, lsh_min_hits from 1 to lsh_tables")


@register("magicpig")
class MagicPIGSelector(TokenSelector):
    Settings = LSHSettings
    estimates = True

    def prepared(self, prompt_keys, lo: int, hi: int, mid: np.ndarray) -> None:
        H, n, d = mid.shape
        rng = np.random.default_rng(0)
        self.tables = []
        for h in range(H):
            planes = rng.standard_normal((self.settings.lsh_tables, self.settings.lsh_bits, d)).astype(np.float32)
            centre = mid[h].mean(0) if n else np.zeros(d, np.float32)
            t = LSHTables(planes, centre.astype(np.float32))
            t.add(mid[h])
            self.tables.append(t)
        self.sampled: list[tuple[np.ndarray, np.ndarray]] = []  # per head: (rows, (G, rows) bias)

    def added(self, head: int, ids: np.ndarray, keys: np.ndarray) -> None:
        self.tables[head].add(keys)

    def choose(self, head: int, queries: np.ndarray, take: int) -> np.ndarray:
        t = self.tables[head]
        keys = self.keys[head].all()
        if len(keys) <= take:  # every key fits the budget: nothing to sample, all exact
            union = np.arange(len(keys))
            self._keep(head, union, np.zeros((len(queries), len(union)), np.float32))
            return union
        counts = np.stack([t.hits(q) for q in queries])  # (G, n)
        hit = counts >= self.settings.lsh_min_hits
        union = np.flatnonzero(hit.any(axis=0))
        if len(union) > take:
            union = union[top_tokens(counts[:, union].max(axis=0).astype(np.float64), take)]
        centred = keys[union] - t.centre
        cos = (queries @ centred.T) / (np.linalg.norm(queries, axis=1)[:, None]
                                       * np.linalg.norm(centred, axis=1)[None, :] + 1e-12)
        lsh = self.settings
        bias = -np.log(sample_probability(cos, lsh.lsh_bits, lsh.lsh_tables, lsh.lsh_min_hits))
        bias[~hit[:, union]] = -np.inf  # a query head uses its own samples only
        self._keep(head, union, bias.astype(np.float32))
        return union

    def _keep(self, head: int, rows: np.ndarray, bias: np.ndarray) -> None:
        if head == 0:
            self.sampled = []
        self.sampled.append((rows, bias))

    def row_bias(self, pool_rows: np.ndarray) -> np.ndarray:
        """Log-weights (H, G, R) of the pool's rows (H, R) host rows (-1: none): a row a query
        head sampled gets -log of its sampling chance, every other row -inf."""
        H, R = pool_rows.shape
        G = self.sampled[0][1].shape[0] if self.sampled else 1
        out = np.full((H, G, R), -np.inf, np.float32)
        for h, (rows, bias) in enumerate(self.sampled):
            if not len(rows):
                continue
            at = np.clip(np.searchsorted(rows, pool_rows[h]), 0, len(rows) - 1)
            ok = (pool_rows[h] >= 0) & (rows[at] == pool_rows[h])
            out[h][:, ok] = bias[:, at[ok]]
        return out

    def release(self) -> None:
        super().release()
        self.tables, self.sampled = [], []
