"""Page selection helpers shared by the index and the baselines."""

from __future__ import annotations

import numpy as np


def merge_group_pages(page_lists: list[np.ndarray], max_pages: int) -> np.ndarray:
    """GQA: merge the ranked page lists of one group's query heads into one list.

    Rank by rank (the first page of each head, then the second of each, ...), keeping the first
    occurrence of each page, cut to ``max_pages``.
    """
    out: list[int] = []
    seen: set[int] = set()
    longest = max((len(p) for p in page_lists), default=0)
    for rank in range(longest):
        for pages in page_lists:
            if rank < len(pages):
                p = int(pages[rank])
                if p not in seen:
                    seen.add(p)
                    out.append(p)
                    if len(out) == max_pages:
                        return np.asarray(out, np.int32)
    return np.asarray(out, np.int32)
