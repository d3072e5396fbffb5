"""The base of the selectors that choose single tokens (:class:`TokenSelector`)."""

from __future__ import annotations

import numpy as np
import torch

from ..spec import IceSpec
from .base import PageSelector
from .tokens import KeyRows, TokenPages, as_numpy


class TokenSelector(PageSelector):
    """A page selector that chooses tokens: per KV head a float32 copy of the offloaded keys
    (``keys[h]``, host rows in order) and a :class:`TokenPages` packing the chosen tokens into the
    pool's pages. Subclasses write :meth:`choose` (and, if they keep state per token, the
    ``prepared`` / ``added`` hooks)."""

    def __init__(self, spec: IceSpec):
        super().__init__(spec)
        self.scale = 1.0
        self.keys: list[KeyRows] = []
        self.pages: list[TokenPages] = []

    # -- the contract -------------------------------------------------------------------------
    def build(self, prompt_keys: torch.Tensor, lo: int, hi: int, capacity: int,
              middle: torch.Tensor | None = None) -> None:
        mid = as_numpy(prompt_keys[:, lo:hi] if middle is None else middle)
        H, _, d = mid.shape
        self.scale = d ** -0.5
        self.keys = []
        for h in range(H):
            rows = KeyRows(d, capacity)
            rows.extend(mid[h])
            self.keys.append(rows)
        self.pages = [TokenPages(self.spec.page_size, max(1, self.spec.pool_pages)) for _ in range(H)]
        self.prepared(prompt_keys, lo, hi, mid)

    def insert(self, keys: torch.Tensor) -> None:
        new = as_numpy(keys)
        for h, rows in enumerate(self.keys):
            ids = rows.extend(new[h])
            self.added(h, ids, new[h])

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        take = min(max_pages, self.pages[0].npages) * self.spec.page_size if self.pages else 0
        out = []
        for h, pages in enumerate(self.pages):
            chosen = self.choose(h, np.asarray(queries[h], np.float32), take)
            out.append(pages.choose(chosen))
        return out

    def page_table(self, head: int):
        return self.pages[head].table()

    def release(self) -> None:
        self.keys, self.pages = [], []

    # -- what a subclass writes ---------------------------------------------------------------
    def prepared(self, prompt_keys: torch.Tensor, lo: int, hi: int, mid: np.ndarray) -> None:
        """After :meth:`build` copied the prompt's offloaded keys ``mid`` (H, n, d)."""

    def added(self, head: int, ids: np.ndarray, keys: np.ndarray) -> None:
        """After :meth:`insert` appended ``keys`` (m, d) of KV head ``head`` as rows ``ids``."""

    def choose(self, head: int, queries: np.ndarray, take: int) -> np.ndarray:
        """At most ``take`` host rows for KV head ``head`` given its group's queries (G, d)."""
        raise NotImplementedError
