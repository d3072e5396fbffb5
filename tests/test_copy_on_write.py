"""A forked cache shares its DCI-trees and host stores with the cache it came from until either
side writes; each side then behaves as an independent copy would."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from icecache.cache.backend import TorchBackend
from icecache.cache.host_store import HostStore
from icecache.index import DCITree, IndexConfig


def _tree_state(t: DCITree) -> dict:
    return {name: getattr(t, name)[: (t.npages if name in t.PAGE_ARRAYS else t.n)].copy()
            for name in (*t.POINT_ARRAYS[:-2], *t.PAGE_ARRAYS)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("promotion,refine", [("random", 0), ("deterministic", 2)])
def test_tree_copy_shares_until_a_write_then_each_side_is_its_own(promotion, refine):
    rng = np.random.default_rng(5)
    a, b, c = (rng.standard_normal((m, 16)).astype(np.float32) for m in (600, 40, 70))
    cfg = IndexConfig(page_size=8, ratio_bottom=0.05, ratio_upper=0.25, promotion=promotion, seed=2,
                      refine=refine, refine_min=32)

    def built(*batches) -> DCITree:
        t = DCITree(16, cfg)
        for x in batches:
            t.insert(x)
        return t

    tree = built(a)
    twin = copy.deepcopy(tree)
    assert np.shares_memory(tree.PX, twin.PX) and np.shares_memory(tree.parent, twin.parent)
    assert not np.shares_memory(tree._sid, twin._sid)  # query scratch is each copy's own
    q = rng.standard_normal((4, 16)).astype(np.float32)
    assert all(np.array_equal(x, y) for x, y in zip(tree.search(q, 10), twin.search(q, 10), strict=True))

    twin.insert(b)  # the twin takes its own arrays; the original is untouched
    assert not np.shares_memory(tree.PX, twin.PX)
    assert _same(_tree_state(tree), _tree_state(built(a)))
    tree.insert(c)
    assert _same(_tree_state(twin), _tree_state(built(a, b)))
    assert _same(_tree_state(tree), _tree_state(built(a, c)))
    for t, ref in ((twin, built(a, b)), (tree, built(a, c))):
        assert all(np.array_equal(x, y) for x, y in zip(t.search(q, 10), ref.search(q, 10), strict=True))


def test_tree_refine_on_a_copy_leaves_the_original():
    rng = np.random.default_rng(8)
    keys = rng.standard_normal((800, 16)).astype(np.float32)
    tree = DCITree(16, IndexConfig(page_size=8, ratio_bottom=0.05, ratio_upper=0.25, seed=1))
    tree.insert(keys)
    before = _tree_state(tree)
    twin = copy.deepcopy(tree)
    assert twin.refine(None, 2) > 0  # something moved, in the twin only
    assert _same(_tree_state(tree), before) and not _same(_tree_state(twin), before)


def test_host_store_copy_shares_rows_until_an_append():
    backend = TorchBackend("cpu")
    store = HostStore(backend, heads=2, head_dim=4, dtype=torch.float32, capacity=16)
    first = torch.randn(2, 6, 4)
    store.append(first, -first)
    twin = copy.deepcopy(store)
    assert twin.keys.data_ptr() == store.keys.data_ptr() and twin.rows == 6
    assert twin.backend is not store.backend
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    twin.append(x, -x)  # within capacity, yet into the twin's own buffers
    assert twin.keys.data_ptr() != store.keys.data_ptr()
    store.append(y, -y)
    assert torch.equal(store.keys[:, :9], torch.cat([first, y], 1))
    assert torch.equal(twin.keys[:, :9], torch.cat([first, x], 1))
    assert torch.equal(twin.values[:, :9], -torch.cat([first, x], 1))
    before = store.keys.data_ptr()
    store.append(y, -y)  # no longer shared, room left: in place; then a full store grows
    assert store.keys.data_ptr() == before
    store.append(torch.randn(2, 5, 4), torch.randn(2, 5, 4))
    assert store.rows == 17 and store.capacity >= 17
    assert torch.equal(store.keys[:, :12], torch.cat([first, y, y], 1))
