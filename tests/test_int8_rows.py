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
