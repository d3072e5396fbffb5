"""``icecache bench index``: the DCI-tree against exact search, Quest and sink+window.

For each captured layer and KV head, the middle keys (between the sink and window pages) are
indexed; each decode query picks pages at a budget; the figure of merit is the share of the
query's full softmax attention mass that falls on sink + window + the selected tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from icecache.index import DCITree, IndexConfig
from icecache.index.select import merge_group_pages

from . import groupings as groupings_mod
from .warm import warm_tree

# Per query head, each with the whole budget (the basis exact top-k has); ``ice_gqa``: the
# group's page lists merged rank by rank into one budget per KV head (what the cache loads).
# ``oracle_pages``: the tree's pages chosen by their exact best member; ``kmeans_pages`` and
# ``parent_pages``: the same keys grouped by k-means (one cluster per page) and by exact nearest
# parent (one parent per page of keys), chosen the same way (``kmeans_gqa``: the group's lists
# merged as the cache merges). The yardsticks are skipped above ``GROUPINGS_MAX`` keys (k-means
# costs keys x clusters per iteration). ``oracle_gqa``: the tree's pages of largest exact
# attention mass summed over the group's queries, one budget per KV head: the most any GQA merge
# of these pages can hold (the ceiling of ``ice_gqa``). ``ice_pick``: the cache's token choice
# (``index_pick``), the budget's tokens of largest estimated group weight (the group's summed
# softmax weights) among every key the walk scored; ``exact_gqa``: the same rule over every key
# with exact scores (its ceiling).
METHODS = ("ice", "oracle_pages", "kmeans_pages", "parent_pages", "exact_topk", "quest", "sink_window",
           "ice_gqa", "ice_pick", "oracle_gqa", "kmeans_gqa", "exact_gqa")
GROUPINGS_MAX = 40_000


@dataclass
class IndexBenchResult:
    keys: int
    budgets: list[int]
    mass: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    recall: dict[int, list[float]] = field(default_factory=dict)
    query_s: dict[str, float] = field(default_factory=lambda: {"ice": 0.0, "exact": 0.0})
    queries_timed: int = 0
    build_s: float = 0.0
    built_keys: int = 0
    insert_s: float = 0.0
    inserted_keys: int = 0
    index_bytes: int = 0
    fill: dict[str, list[float]] = field(default_factory=dict)  # keys per page / page size

    def summary(self, budget: int = 256) -> dict:
        b = budget if budget in self.mass else self.budgets[-1]
        ice_us = 1e6 * self.query_s["ice"] / max(1, self.queries_timed)
        exact_us = 1e6 * self.query_s["exact"] / max(1, self.queries_timed)
        return {
            "keys": self.keys,
            "budget": b,
            "attention_mass": {m: float(np.mean(v)) for m, v in self.mass[b].items() if v},
            "attention_mass_by_budget": {
                str(bb): {m: float(np.mean(v)) for m, v in d.items() if v} for bb, d in self.mass.items()
            },
            "page_fill": {m: float(np.mean(v)) for m, v in self.fill.items()},
            "recall_at_64": float(np.mean(self.recall[64])),
            "recall_at_256": float(np.mean(self.recall[256])),
            "query_us_per_head": {"ice": ice_us, "exact": exact_us},
            "speedup_vs_exact": exact_us / ice_us if ice_us else 0.0,
            "build_us_per_key": 1e6 * self.build_s / max(1, self.built_keys),
            "insert_us_per_key": 1e6 * self.insert_s / max(1, self.inserted_keys),
            "bytes_per_key": self.index_bytes / max(1, self.built_keys + self.inserted_keys),
        }


def quest_pages(mid_keys: np.ndarray, q: np.ndarray, page_size: int, max_pages: int) -> np.ndarray:
    """Quest: token-order pages, score = sum_i max(q_i min_i, q_i max_i), best pages first."""
    n = mid_keys.shape[0] // page_size * page_size
    pages = mid_keys[:n].reshape(-1, page_size, mid_keys.shape[1])
    tail = mid_keys[n:]
    lo, hi = pages.min(1), pages.max(1)
    if len(tail):
        lo = np.concatenate([lo, tail.min(0, keepdims=True)])
        hi = np.concatenate([hi, tail.max(0, keepdims=True)])
    score = np.maximum(lo * q, hi * q).sum(1)
    return np.argsort(-score, kind="stable")[:max_pages]


def _mass(p: np.ndarray, fixed: np.ndarray, chosen: np.ndarray) -> float:
    sel = np.zeros(p.shape[0], bool)
    sel[fixed] = True
    sel[chosen] = True
    return float(p[sel].sum())


def run_layer(res: IndexBenchResult, keys: np.ndarray, queries: np.ndarray, page_size: int,
              sink_pages: int, window_pages: int, cfg: IndexConfig) -> None:
    """keys (kv_heads, n, d), queries (heads, steps, d) of one layer."""
    kv_heads, n, d = keys.shape
    heads, steps, _ = queries.shape
    group = heads // kv_heads
    sink, window = sink_pages * page_size, window_pages * page_size
    mid = np.arange(sink, n - window)
    fixed = np.concatenate([np.arange(sink), np.arange(n - window, n)])
    torch.set_num_threads(1)
    warm_tree(d, group)  # numba compiles on first use: not in the timers
    torch.topk(torch.zeros(max(res.budgets) + 1), max(res.budgets))
    for kvh in range(kv_heads):
        K = keys[kvh]
        M = np.ascontiguousarray(K[mid])
        tree = DCITree(d, cfg, capacity=len(mid))
        n_build = len(mid) - len(mid) // 10
        t0 = time.perf_counter()
        tree.insert(M[:n_build])
        res.build_s += time.perf_counter() - t0
        res.built_keys += n_build
        t0 = time.perf_counter()
        for lo in range(n_build, len(mid), page_size):  # the rest arrives a window page at a time
            tree.insert(M[lo : lo + page_size])
        res.insert_s += time.perf_counter() - t0
        res.inserted_keys += len(mid) - n_build
        res.index_bytes += tree.nbytes()
        Mt = torch.from_numpy(M)
        page_of = tree.tok_page[: tree.n]
        live = tree.live_pages()
        res.fill.setdefault("tree", []).append(len(M) / (len(live) * page_size))
        groupings = {}
        if len(M) <= GROUPINGS_MAX:
            rows = groupings_mod.mips_rows(M)
            groupings["kmeans_pages"] = groupings_mod.kmeans_pages(rows, page_size)
            groupings["parent_pages"] = groupings_mod.nearest_parent_pages(rows, page_size, page_size)
            for name, g in groupings.items():
                res.fill.setdefault(name.removesuffix("_pages"), []).append(groupings_mod.page_fill(g, page_size))
        for step in range(steps):
            qs = queries[kvh * group : (kvh + 1) * group, step]
            probs = []
            for q in qs:
                s = K @ q / np.sqrt(d)
                e = np.exp(s - s.max())
                probs.append(e / e.sum())
            # Timed: the index's top-k search (the group's query heads walking the tree together,
            # as the cache does) vs exact scoring + top-k, per query head.
            t0 = time.perf_counter()
            ids, _ = tree.search_group(qs, max(res.budgets))
            res.query_s["ice"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            for q in qs:
                torch.topk(Mt @ torch.from_numpy(q), max(res.budgets))
            res.query_s["exact"] += time.perf_counter() - t0
            res.queries_timed += len(qs)
            exact_scores = [M @ q for q in qs]
            for k in (64, 256):
                for r, sc in enumerate(exact_scores):
                    ref = np.argsort(-sc, kind="stable")[:k]
                    res.recall.setdefault(k, []).append(len(set(ids[r, :k].tolist()) & set(ref.tolist())) / k)
            for budget in res.budgets:
                P = budget // page_size
                table = res.mass.setdefault(budget, {m: [] for m in METHODS})
                pick_tok = mid[tree.pick_group(qs, budget, P)[1]]
                group_w = sum(p[mid] for p in probs)
                exact_gqa_tok = mid[np.argsort(-group_w, kind="stable")[:budget]]
                ice = [tree_pages(ids[r], page_of, P) for r in range(len(qs))]
                oracle = []
                for sc in exact_scores:
                    best = np.full(tree.npages, -np.inf)
                    np.maximum.at(best, page_of, sc)
                    oracle.append(live[np.argsort(-best[live], kind="stable")][:P])
                merged = tree.select_group(qs, budget, P)  # the cache's own selection
                gqa_tok = mid[np.isin(page_of, merged)]
                group_mass = np.bincount(page_of, weights=group_w, minlength=tree.npages)
                best_group = live[np.argsort(-group_mass[live], kind="stable")][:P]
                oracle_gqa_tok = mid[np.isin(page_of, best_group)]
                chosen = {name: [groupings_mod.oracle_pages(g, sc, P) for sc in exact_scores]
                          for name, g in groupings.items()}
                if "kmeans_pages" in chosen:
                    km_merged = merge_group_pages(chosen["kmeans_pages"], P)
                    km_gqa = mid[np.isin(groupings["kmeans_pages"], km_merged)]
                for r, p in enumerate(probs):
                    quest = quest_pages(M, qs[r], page_size, P)
                    q_tok = (np.concatenate([mid[g * page_size : (g + 1) * page_size] for g in quest])
                             if len(quest) else mid[:0])
                    table["ice"].append(_mass(p, fixed, mid[np.isin(page_of, ice[r])]))
                    table["oracle_pages"].append(_mass(p, fixed, mid[np.isin(page_of, oracle[r])]))
                    table["quest"].append(_mass(p, fixed, q_tok))
                    table["exact_topk"].append(_mass(p, fixed, mid[np.argsort(-exact_scores[r])[:budget]]))
                    table["sink_window"].append(_mass(p, fixed, mid[:0]))
                    table["ice_gqa"].append(_mass(p, fixed, gqa_tok))
                    table["ice_pick"].append(_mass(p, fixed, pick_tok))
                    table["oracle_gqa"].append(_mass(p, fixed, oracle_gqa_tok))
                    table["exact_gqa"].append(_mass(p, fixed, exact_gqa_tok))
                    for name, g in groupings.items():
                        table[name].append(_mass(p, fixed, mid[np.isin(g, chosen[name][r])]))
                    if "kmeans_pages" in chosen:
                        table["kmeans_gqa"].append(_mass(p, fixed, km_gqa))


def tree_pages(ids: np.ndarray, page_of: np.ndarray, max_pages: int) -> np.ndarray:
    """Distinct pages of ranked ids, best first (the same rule as ``DCITree.select_pages``)."""
    from icecache.index import kernels

    ids = ids[ids >= 0].astype(np.int32)
    return kernels.ranked_pages(ids, page_of.astype(np.int32), max_pages)
