"""The selector registry and :class:`HeadIndexes`, the base of the selectors that keep an index
per KV head."""

from __future__ import annotations

import numpy as np
import torch

from ..spec import IceSpec

SELECTORS: dict[str, type] = {}


def register(name: str):
    """Class decorator: make a selector known under ``name``."""

    def add(cls):
        SELECTORS[name] = cls
        cls.name = name
        return cls

    return add


class HeadIndexes:
    """One index per KV head (``new_index``), with the page versions the pool compares against.

    An index offers ``insert(keys) -> dirty pages``, ``members``/``count``/``npages`` and
    ``select_group(queries, k, max_pages) -> pages``.
    """

    name = ""
    indexed = True
    waits_for_queries = False
    budget_in_index = False  # True: the index was built for one budget (no fork to another)

    def __init__(self, spec: IceSpec):
        self.spec = spec
        self.head_dim = 0
        self.indexes: list = []
        self.versions: list[np.ndarray] = []

    def new_index(self, head: int, capacity: int):
        """An empty index for KV head ``head`` (``self.head_dim`` is known by then)."""
        raise NotImplementedError

    def observe(self, queries: torch.Tensor, positions=None) -> None:
        pass

    def build(self, prompt_keys: torch.Tensor, lo: int, hi: int, capacity: int,
              middle: torch.Tensor | None = None) -> None:
        middle = prompt_keys[:, lo:hi] if middle is None else middle
        keys = middle.float().cpu().numpy()  # the keys before any host rounding
        self.head_dim = keys.shape[2]
        self.indexes, self.versions = [], []
        for h in range(keys.shape[0]):
            index = self.new_index(h, capacity)
            index.insert(keys[h])
            self.indexes.append(index)
            self.versions.append(np.zeros(max(64, index.npages * 2), np.int64))

    def insert(self, keys: torch.Tensor) -> None:
        keys_np = keys.float().numpy()
        for h, index in enumerate(self.indexes):
            dirty = index.insert(keys_np[h])
            ver = self.versions[h]
            if index.npages > len(ver):
                grown = np.zeros(2 * index.npages, np.int64)
                grown[: len(ver)] = ver
                self.versions[h] = ver = grown
            ver[dirty] += 1

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        k = max_pages * self.spec.page_size
        return [index.select_group(queries[h], k, max_pages) for h, index in enumerate(self.indexes)]

    def page_table(self, head: int):
        index = self.indexes[head]
        return index.members, index.count, self.versions[head]

    def release(self) -> None:
        self.indexes, self.versions = [], []
