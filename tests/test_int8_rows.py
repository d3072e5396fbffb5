"""The tiled int8 row product (icecache.int8_rows) against its plain reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache import int8_rows
from icecache.weights import quantize_rows


@pytest.mark.parametrize("rows,inputs", [(64, 32), (200, 96), (1, 576), (130, 640)])
def test_the_tiles_hold_each_row_and_pad_the_last_tile_with_zeros(rows, inputs):
    q = torch.randint(-127, 128, (rows, inputs), dtype=torch.int8)
    tiles = int8_rows.tile(q)
    nb = -(-rows // int8_rows.BLOCK)
    assert tiles.shape == (nb, inputs, int8_rows.BLOCK) and tiles.flags.c_contiguous
    back = tiles.transpose(0, 2, 1).reshape(nb * int8_rows.BLOCK, inputs)
    assert np.array_equal(back[:rows], q.numpy()) and not back[rows:].any()


@pytest.mark.parametrize("rows,inputs,bias", [(200, 96, False), (130, 640, True), (64, 576, False)])
def test_the_product_is_the_dequantized_rows_within_the_sums_bound(rows, inputs, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, inputs, generator=g) * torch.linspace(0.1, 3.0, rows)[:, None]
    q, scale = quantize_rows(w)
    x = torch.randn(inputs, generator=g) * 4
    b = torch.randn(rows, generator=g) if bias else None
    out, upper, floor = int8_rows.product(int8_rows.tile(q), scale, x, rows, b)
    ref = int8_rows.reference(q, scale, x) + (b.double() if bias else 0)
    terms = (q.double().abs() * scale.double()[:, None]) @ x.double().abs()
    err = (out.double() - ref).abs()
    assert bool((err <= int8_rows.sum_error(inputs) * terms + ref.abs() * 2.0 ** -23 + 1e-6).all())
    assert err.max() > 0 or rows == 64  # float32 sums: the check above is not vacuous on these sizes
    # no bound given: upper is the product up to the sum's own rounding, floor its largest value
    assert bool(((upper - out).abs() <= out.abs() * 2.0 ** -22 + 2e-6).all())
    assert abs(floor - float(out.max())) <= abs(float(out.max())) * 2.0 ** -22 + 2e-6


def test_the_bound_widens_each_row_by_its_own_share():
    q = torch.tensor([[1, 0], [0, 1], [1, 1]], dtype=torch.int8)
    scale = torch.ones(3)
    x = torch.tensor([2.0, -1.0])
    bound = torch.tensor([0.0, 0.5, 0.25])
    out, upper, floor = int8_rows.product(int8_rows.tile(q), scale, x, 3, None, bound, l1=3.0)
    assert torch.equal(out, torch.tensor([2.0, -1.0, 1.0]))
    assert torch.allclose(upper - out, torch.tensor([0.0, 1.5, 0.75]), atol=2e-6)
    assert floor == pytest.approx(2.0, abs=2e-6)  # row 0: 2 - 0 (row 2: 1 - 0.75)


@pytest.mark.parametrize("levels", [256, 16, 2])  # bytes; 4-bit values, two a byte (and only 0/1 there)
@pytest.mark.parametrize("rows,inputs", [(100, 96), (64, 640), (3, 32)])
def test_the_grouped_product_is_the_exact_values_within_its_bound(rows, inputs, levels):
    rng = np.random.default_rng(rows)
    u = rng.integers(0, levels, (rows, inputs), dtype=np.uint8)
    u[0, :2] = [levels - 1, 0]  # both ends of the range in one byte
    step = rng.uniform(1e-4, 1e-2, (rows, inputs // 32)).astype(np.float32)
    low = rng.uniform(-1, 1, (rows, inputs // 32)).astype(np.float32)
    tiles, tables = int8_rows.tile_groups(u, step, low)
    nb = -(-rows // int8_rows.BLOCK)
    per_byte = 1 if levels > 16 else 2
    assert tiles.shape == (nb, inputs // per_byte, int8_rows.BLOCK)
    assert tables.shape == (nb, inputs // 32, 2, int8_rows.BLOCK)
    x = rng.standard_normal(inputs).astype(np.float32)
    out = np.empty(rows, np.float32)
    int8_rows.grouped_product(tiles, tables, x, out)
    w = u.astype(np.float64) * np.repeat(step, 32, 1) + np.repeat(low, 32, 1)
    ref = w @ x.astype(np.float64)
    terms = (u * np.repeat(step, 32, 1) + np.abs(np.repeat(low, 32, 1))) @ np.abs(x.astype(np.float64))
    err = np.abs(out - ref)
    assert (err <= int8_rows.grouped_sum_error(inputs) * terms).all()
    assert err.max() > 0  # float32 sums: the bound above is what holds them, not luck
