"""Token-level choices in the paged pool: :class:`TokenPages`, and what the token selectors share.

The resident pool loads pages (``page_size`` host rows each). A selector that chooses single
tokens (``h2o``, ``omnikv``, ``pqcache``, ``magicpig``) packs its chosen tokens into pages of its
own: a token keeps its page slot while it stays chosen, a token that leaves frees its slot, a new
one takes a free slot, and only the pages whose members changed get a new version (the pool
reloads just those). Each page keeps its members packed at the front (``members[p, :count[p]]``),
which is what the pool's loader reads.
"""

from __future__ import annotations

import numpy as np
import torch

from ...index.walk import marks
from ..kernels import choose_tokens


class TokenPages:
    """One KV head's chosen tokens as at most ``pages`` pages of ``page_size`` host rows."""

    def __init__(self, page_size: int, pages: int):
        self.S = page_size
        self.npages = pages
        self.members = np.full((pages, page_size), -1, np.int32)
        self.count = np.zeros(pages, np.int32)
        self.version = np.zeros(pages, np.int64)

    @property
    def capacity(self) -> int:
        return self.npages * self.S

    def tokens(self) -> np.ndarray:
        """The chosen tokens (in page order)."""
        return self.members[self.members >= 0]

    def choose(self, tokens: np.ndarray) -> np.ndarray:
        """Make ``tokens`` (distinct host rows, at most ``capacity``) the chosen set; return
        the ids of the pages holding them (one numba pass, :func:`~..kernels.choose_tokens`)."""
        tokens = np.asarray(tokens, np.int32)
        if len(tokens) > self.capacity:
            raise ValueError(f"{len(tokens)} tokens do not fit {self.npages} pages of {self.S}")
        top = max(int(tokens.max(initial=0)), int(self.members.max()))
        return choose_tokens(self.members, self.count, self.version, tokens, marks(top + 1))

    def choose_reference(self, tokens: np.ndarray) -> np.ndarray:
        """NumPy reference of :meth:`choose` (the same contract, tested equal)."""
        tokens = np.asarray(tokens, np.int32)
        if len(tokens) > self.capacity:
            raise ValueError(f"{len(tokens)} tokens do not fit {self.npages} pages of {self.S}")
        held = self.members >= 0
        stay = held & np.isin(self.members, tokens)
        changed = (held & ~stay).any(axis=1)
        self.members[held & ~stay] = -1
        new = np.setdiff1d(tokens, self.members[stay], assume_unique=True)
        if len(new):
            free = np.flatnonzero(self.members.ravel() < 0)[: len(new)]
            self.members.ravel()[free] = new
            changed[np.unique(free // self.S)] = True
        for p in np.flatnonzero(changed):  # pack the page's members at its front
            row = self.members[p]
            kept = row[row >= 0]
            row[:] = -1
            row[: len(kept)] = kept
            self.count[p] = len(kept)
        self.version[changed] += 1
        return np.flatnonzero(self.count > 0).astype(np.int32)

    def clear(self) -> None:
        """Choose nothing (the pages that held tokens get new versions)."""
        self.version[self.count > 0] += 1
        self.members[:] = -1
        self.count[:] = 0

    def table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.members, self.count, self.version


def group_weights(queries: np.ndarray, keys: np.ndarray, scale: float, softcap: float | None = None) -> np.ndarray:
    """The group's attention weights on ``keys``, summed over its queries: queries (G, d), keys
    (n, d) -> (n,) float64 (each query's softmax over the n keys; ``softcap``: of the scores
    capped as the model caps them, ``cap * tanh(score / cap)``)."""
    if len(keys) == 0:
        return np.zeros(0)
    s = (np.asarray(queries, np.float64) @ np.asarray(keys, np.float64).T) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s -= s.max(axis=1, keepdims=True)
    e = np.exp(s)
    return (e / e.sum(axis=1, keepdims=True)).sum(axis=0)


def top_tokens(score: np.ndarray, take: int) -> np.ndarray:
    """Indices of the ``take`` largest scores (ties: the lower index), in index order."""
    take = min(take, len(score))
    if take <= 0:
        return np.empty(0, np.int64)
    if take == len(score):
        return np.arange(len(score))
    order = np.argsort(-score, kind="stable")[:take]
    return np.sort(order)


class KeyRows:
    """A growing float32 copy of one KV head's offloaded keys (host rows in order), for the
    selectors that score tokens exactly or re-encode them."""

    def __init__(self, head_dim: int, capacity: int = 1024):
        self.rows = np.zeros((max(16, capacity), head_dim), np.float32)
        self.n = 0

    def extend(self, keys: np.ndarray) -> np.ndarray:
        """Append keys (m, d); return their row ids."""
        m = len(keys)
        if self.n + m > len(self.rows):
            grown = np.zeros((max(self.n + m, len(self.rows) + len(self.rows) // 2), self.rows.shape[1]),
                             np.float32)
            grown[: self.n] = self.rows[: self.n]
            self.rows = grown
        self.rows[self.n : self.n + m] = keys
        self.n += m
        return np.arange(self.n - m, self.n)

    def all(self) -> np.ndarray:
        return self.rows[: self.n]


def as_numpy(keys: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(keys, torch.Tensor):
        return keys.detach().float().cpu().numpy()
    return np.asarray(keys, np.float32)


class QueryGrid:
    """Prompt queries kept at a uniform grid of positions, at most ``limit`` of them (the grid's
    step doubles when more arrive), plus the prompt's last ``tail`` positions: what H2O's
    accumulated prompt attention is estimated from. Stored in float16."""

    def __init__(self, limit: int, tail: int):
        self.limit, self.tail = limit, tail
        self.queries: dict[int, torch.Tensor] = {}  # position -> (Hq, d)
        self.stride, self.last = 1, -1

    def add(self, queries: torch.Tensor, positions: np.ndarray | None = None) -> None:
        """queries (Hq, C, d) at ``positions`` (default: the C positions after the last one)."""
        C = queries.shape[1]
        if positions is None:
            positions = np.arange(self.last + 1, self.last + 1 + C)
        positions = np.asarray(positions, np.int64)
        if not len(positions):
            return
        last = max(self.last, int(positions.max()))
        moved, self.last = last != self.last, last
        # The stride this add ends with, found first: the positions it keeps are those of the
        # held and the new ones on its grid (a coarser grid keeps a subset of a finer one), so
        # only they are copied. Copying every position the old stride kept (most of them
        # dropped right after), one by one, cost 9% of an 8k prefill's speed; this way about
        # 3%.
        held = np.fromiter(self.queries, np.int64, len(self.queries))
        every = np.unique(np.concatenate([held, positions]))
        stride = self.stride
        while np.count_nonzero(self._kept_mask(every, self.stride)) > self.limit + self.tail:
            self.stride *= 2
        kept = np.flatnonzero(self._kept_mask(positions, self.stride))
        if moved or self.stride != stride:  # off the grid and no longer in the tail: dropped
            self.queries = {p: self.queries[p] for p in held[self._kept_mask(held, self.stride)].tolist()}
        if len(kept):
            # one float16 copy of the kept queries, then one small copy each (a view would keep
            # the whole copy alive)
            picked = queries.detach()[:, torch.from_numpy(kept)].to("cpu", torch.float16)
            for j, p in enumerate(positions[kept].tolist()):
                self.queries[p] = picked[:, j].clone()

    def _kept_mask(self, positions: np.ndarray, stride: int) -> np.ndarray:
        """Which ``positions`` a grid of ``stride`` keeps: its points and the tail."""
        return ((positions + 1) % stride == 0) | (positions > self.last - self.tail)

    def merge(self, other: QueryGrid) -> None:
        for p, q in sorted(other.queries.items()):
            self.add(q[:, None], np.array([p]))

    def arrays(self, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries (Hq, n, d) float32 at positions before ``end``, the positions (n,) and each
        one's weight: the positions it stands for (from the previous kept one)."""
        pos = np.array(sorted(p for p in self.queries if p < end), np.int64)
        if not len(pos):
            return np.zeros((0, 0, 0), np.float32), pos, np.zeros(0)
        weights = np.diff(np.concatenate([[-1], pos])).astype(np.float64)
        q = torch.stack([self.queries[int(p)] for p in pos], dim=1).float().numpy()
        return q, pos, weights

    def __len__(self) -> int:
        return len(self.queries)
