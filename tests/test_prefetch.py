"""The cache hint that numba kernels give before reading rows they chose (icecache/prefetch.py)."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from numba import njit

from icecache.prefetch import prefetch_row


@njit(cache=False)
def _gather(store, rows, out):
    """out[i] = store[rows[i]], every row hinted first (as load_pool does)."""
    for i in range(rows.shape[0]):
        prefetch_row(store, rows[i], store.shape[1] * store.itemsize)
    for i in range(rows.shape[0]):
        out[i] = store[rows[i]]


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_a_hinted_gather_reads_what_a_plain_one_does(dtype):
    rng = np.random.default_rng(0)
    store = rng.integers(0, 60000, (500, 72)).astype(dtype)
    rows = rng.integers(0, 500, 97).astype(np.int64)
    out = np.zeros((97, 72), dtype)
    _gather(store, rows, out)
    assert np.array_equal(out, store[rows])
    assert not np.array_equal(out, store[rows + 1 - 500 * (rows == 499)])  # the check can fail


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 instructions")
def test_the_hint_is_a_prefetch_instruction_on_x86():
    store = np.zeros((8, 64), np.float32)
    _gather(store, np.arange(4, dtype=np.int64), np.zeros((4, 64), np.float32))
    asm = "\n".join(_gather.inspect_asm().values())
    assert "prefetcht0" in asm
