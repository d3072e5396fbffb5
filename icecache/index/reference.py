"""Plain NumPy references for the index kernels, used by the tests (slow, obviously right)."""

from __future__ import annotations

import numpy as np


def exact_topk(keys: np.ndarray, query: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` keys of largest inner product with ``query``, best first."""
    scores = keys @ query
    order = np.argsort(-scores, kind="stable")
    return order[:k]


def mip_transform(keys: np.ndarray, M: float | None = None) -> np.ndarray:
    """``[k, sqrt(M - |k|^2)]`` for each key (M defaults to the max squared norm)."""
    sq = (keys.astype(np.float64) ** 2).sum(1)
    M = sq.max() if M is None else M
    return np.concatenate([keys, np.sqrt(np.maximum(M - sq, 0))[:, None]], 1)


def nearest(points: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Index into ``candidates`` of the Euclidean nearest candidate of each point."""
    d2 = ((points[:, None, :] - candidates[None, :, :]) ** 2).sum(-1)
    return d2.argmin(1)


def ranked_pages(ids, tok_page, max_pages: int) -> list[int]:
    """Distinct pages of ``ids`` in order of their first (best) member, at most ``max_pages``."""
    out: list[int] = []
    for i in ids:
        p = int(tok_page[i])
        if p not in out:
            out.append(p)
        if len(out) == max_pages:
            break
    return out


def nearest_inner(rows: np.ndarray, C: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """For each row, the id in ``cand`` of the candidate (rows of ``C``) of largest inner product."""
    return cand[np.argmax(rows.astype(np.float64) @ C.T.astype(np.float64), axis=1)]
