"""StreamingLLM as a selector: no pages at all; attention sees the sink and the window."""

from __future__ import annotations

import numpy as np
import torch

from .base import register


@register("streaming")
class StreamingSelector:
    indexed = False
    waits_for_queries = False
    budget_in_index = False

    def __init__(self, spec):
        self.spec = spec

    def observe(self, queries: torch.Tensor, positions=None) -> None:
        pass

    def build(self, prompt_keys, lo: int, hi: int, capacity: int, middle=None) -> None:
        pass

    def insert(self, keys) -> None:
        pass

    def select(self, queries, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        return [np.empty(0, np.int32) for _ in range(queries.shape[0])]

    def page_table(self, head: int):
        raise LookupError("the streaming selector has no pages")

    def release(self) -> None:
        pass
