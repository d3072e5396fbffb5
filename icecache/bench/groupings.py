"""Other ways to group the same keys into pages, as yardsticks for the DCI-tree's pages in
``icecache bench index`` (measurement code in NumPy, not a fast path).

Every grouping works in the tree's own space, the max-inner-product transform
``k -> [k, sqrt(M - |k|^2)]`` (nearest there = largest inner product), and returns ``page_of``:
one page id per key, pages of at most ``page_size`` keys. A group larger than a page is cut into
runs along a random direction, as the tree cuts a node's children.
"""

from __future__ import annotations

import numpy as np


def mips_rows(keys: np.ndarray) -> np.ndarray:
    """The max-inner-product transform of keys (n, d) -> (n, d + 1), float32."""
    keys = np.asarray(keys, np.float32)
    sq = np.einsum("ij,ij->i", keys, keys)
    extra = np.sqrt(np.maximum(sq.max(initial=0.0) - sq, 0.0))
    return np.concatenate([keys, extra[:, None]], 1).astype(np.float32)


def cut_into_pages(labels: np.ndarray, page_size: int, direction_scores: np.ndarray) -> np.ndarray:
    """Groups (``labels``, one per key) -> pages: each group's keys in order of
    ``direction_scores``, cut into as few near-equal runs of at most ``page_size`` as fit.
    Returns ``page_of`` (pages numbered from 0, no empty page)."""
    page_of = np.empty(len(labels), np.int64)
    order = np.lexsort((direction_scores, labels))
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    page = 0
    for group in np.split(order, bounds):
        if not len(group):
            continue
        runs = -(-len(group) // page_size)
        for run in np.array_split(group, runs):
            page_of[run] = page
            page += 1
    return page_of


def nearest_parent_pages(rows: np.ndarray, page_size: int, parent_every: int, seed: int = 0) -> np.ndarray:
    """Every ``parent_every``-th key is a parent; each key joins its exact nearest parent (largest
    inner product of transformed keys); groups cut into pages."""
    parents = rows[::parent_every]
    labels = np.empty(len(rows), np.int64)
    for lo in range(0, len(rows), 4096):
        labels[lo : lo + 4096] = np.argmax(rows[lo : lo + 4096] @ parents.T, axis=1)
    return cut_into_pages(labels, page_size, rows @ _direction(rows.shape[1], seed))


def kmeans_labels(rows: np.ndarray, clusters: int, iters: int = 10, seed: int = 0) -> np.ndarray:
    """Lloyd's k-means (squared Euclidean distance), seeded from distinct random keys; an empty
    cluster keeps its centre. Returns each key's cluster."""
    rng = np.random.default_rng(seed)
    clusters = max(1, min(clusters, len(rows)))
    centres = rows[rng.choice(len(rows), clusters, replace=False)].astype(np.float64)
    x = rows.astype(np.float64)
    labels = np.zeros(len(rows), np.int64)
    for _ in range(iters):
        labels = nearest_centre(x, centres)
        sums = np.zeros_like(centres)
        np.add.at(sums, labels, x)
        counts = np.bincount(labels, minlength=clusters)
        full = counts > 0
        centres[full] = sums[full] / counts[full, None]
    return nearest_centre(x, centres)


def nearest_centre(x: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Index of each row's nearest centre (squared Euclidean), in blocks."""
    c2 = np.einsum("ij,ij->i", centres, centres)
    out = np.empty(len(x), np.int64)
    for lo in range(0, len(x), 4096):
        block = x[lo : lo + 4096]
        out[lo : lo + len(block)] = np.argmin(c2[None] - 2 * block @ centres.T, axis=1)
    return out


def kmeans_pages(rows: np.ndarray, page_size: int, iters: int = 10, seed: int = 0) -> np.ndarray:
    """k-means with one cluster per ``page_size`` keys; clusters cut into pages."""
    labels = kmeans_labels(rows, len(rows) // page_size, iters, seed)
    return cut_into_pages(labels, page_size, rows @ _direction(rows.shape[1], seed))


def oracle_pages(page_of: np.ndarray, scores: np.ndarray, max_pages: int) -> np.ndarray:
    """The ``max_pages`` pages whose best member scores highest (the rule the tree's search
    follows: a page ranks by its best key), best first."""
    pages = int(page_of.max()) + 1 if len(page_of) else 0
    best = np.full(pages, -np.inf)
    np.maximum.at(best, page_of, scores)
    return np.argsort(-best, kind="stable")[:max_pages]


def page_fill(page_of: np.ndarray, page_size: int) -> float:
    """Keys per page over the page size (1.0: every page full)."""
    pages = len(np.unique(page_of))
    return len(page_of) / (pages * page_size) if pages else 0.0


def _direction(dim: int, seed: int) -> np.ndarray:
    u = np.random.default_rng(seed + 7919).standard_normal(dim)
    u[-1] = 0.0  # as the tree: orthogonal to the transform's extra coordinate
    return (u / np.linalg.norm(u)).astype(np.float32)
