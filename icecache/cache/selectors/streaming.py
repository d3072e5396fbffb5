"""StreamingLLM as a selector: no pages at all; attention sees the sink and the window."""

from __future__ import annotations

import numpy as np

from .base import PageSelector, register


@register("streaming")
class StreamingSelector(PageSelector):
    indexed = False

    def build(self, prompt_keys, lo: int, hi: int, capacity: int, middle=None) -> None:
        pass

    def insert(self, keys) -> None:
        pass

    def select(self, queries, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        return [np.empty(0, np.int32) for _ in range(queries.shape[0])]

    def page_table(self, head: int):
        raise LookupError("the streaming selector has no pages")
