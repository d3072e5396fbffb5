"""IceCache's selector: one DCI-tree per KV head (:class:`~icecache.index.DCITree`), pages of
keys clustered by similarity, searched top-down by the step's query heads (paper, section 4)."""

from __future__ import annotations

import os

import numpy as np

from ...index import DCITree
from ...index.walk import select_layer
from .base import HeadIndexes, register

# A layer's KV heads queried by one parallel numba call (index.walk.select_layer); 0: one by one.
PARALLEL_HEADS = os.environ.get("ICECACHE_PARALLEL_HEADS", "1") != "0"


@register("dci")
class DCISelector(HeadIndexes):
    def new_index(self, head: int, capacity: int) -> DCITree:
        return DCITree(self.head_dim, self.spec.index, capacity=capacity)

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        k = max_pages * self.spec.page_size
        if not PARALLEL_HEADS:
            return [index.select_group(queries[h], k, max_pages, wide) for h, index in enumerate(self.indexes)]
        return select_layer(self.indexes, queries, k, max_pages, wide)
