"""4-bit products with the input rounded to int16 (icecache.int16_inputs) against their references."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit, types
from numba.extending import intrinsic

from icecache import int16_inputs
from icecache.int8_rows import GROUP, grouped_product, tile_groups


def _layer(rows, inputs, levels=16, seed=0):
    rng = np.random.default_rng(seed)
    u = rng.integers(0, levels, (rows, inputs)).astype(np.uint8)
    step = (rng.random((rows, inputs // GROUP)) * 0.02).astype(np.float32)
    low = (-8 * step + rng.standard_normal(step.shape).astype(np.float32) * 0.01).astype(np.float32)
    x = rng.standard_normal(inputs).astype(np.float32)
    x[:GROUP] = 0.0  # a group of zeros: step 0
    return u, step, low, x


def _madd_kernel(fast, wide=False):
    words, longs = ((int16_inputs._WORDS32, int16_inputs._LONGS16) if wide else
                    (int16_inputs._WORDS, int16_inputs._LONGS))

    @intrinsic
    def madd(typingctx, w, x, out):
        sig = types.void(w, x, out)

        def codegen(context, builder, signature, args):
            ptrs = [builder.bitcast(context.make_array(t)(context, builder, a).data, ty.as_pointer())
                    for t, a, ty in zip(signature.args, args, (words, words, longs), strict=True)]
            got = int16_inputs._madd_pairs(builder, builder.load(ptrs[0], align=1), builder.load(ptrs[1], align=1), fast)
            builder.store(got, ptrs[2], align=1)
            return context.get_dummy_value()

        return sig, codegen

    @njit(cache=False)
    def run(w, x, out):
        madd(w, x, out)

    return run


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_the_pair_sums_are_exact_in_both_forms(fast, wide):
    """vpmaddwd on 256-bit (AVX2) and 512-bit (AVX-512 BW) registers, and the plain vector
    arithmetic that stands in for each elsewhere."""
    if fast and not (int16_inputs.avx512() if wide else int16_inputs.avx2()):
        pytest.skip("no AVX-512 BW on this CPU" if wide else "no AVX2 on this CPU")
    rng = np.random.default_rng(1)
    run = _madd_kernel(fast, wide)
    n = 32 if wide else 16
    for _ in range(20):
        w = rng.integers(0, 16, n).astype(np.int16)
        x = rng.integers(-32767, 32768, n).astype(np.int16)
        out = np.zeros(n // 2, np.int32)
        run(w, x, out)
        want = (w.astype(np.int64) * x.astype(np.int64)).reshape(n // 2, 2).sum(axis=1)
        assert np.array_equal(out, want)


@njit(cache=False)
def _isums(tiles, b, j0, xq, x0, out):
    int16_inputs.group_isums(tiles, b, j0, xq, x0, out)


def test_a_group_sum_is_the_integer_dot_product():
    u, step, low, _ = _layer(130, 96)
    u[:, :32] = 15
    tiles, _tables = tile_groups(u, step, low)
    xq = np.random.default_rng(2).integers(-32767, 32768, 96).astype(np.int16)
    xq[:32] = 32767  # the largest sums a group can have
    out = np.zeros(64, np.int32)
    for b, g in ((0, 0), (1, 2), (2, 1)):  # the last tile is padded with zero rows
        _isums(tiles, b, g * 16, xq, g * GROUP, out)
        rows = u[b * 64 : (b + 1) * 64, g * GROUP : (g + 1) * GROUP].astype(np.int64)
        want = np.zeros(64, np.int64)
        want[: len(rows)] = rows @ xq[g * GROUP : (g + 1) * GROUP].astype(np.int64)
        assert np.array_equal(out, want)


@pytest.mark.parametrize("rows,inputs", [(64, 64), (200, 576), (576, 1536)])
def test_the_int16_product_is_its_reference_and_near_the_float_one(rows, inputs):
    u, step, low, x = _layer(rows, inputs)
    tiles, tables = tile_groups(u, step, low)
    assert tiles.shape[1] * 2 == inputs  # two values a byte
    got = np.zeros(rows, np.float32)
    int16_inputs.int16_product(tiles, tables, x, got)
    want = int16_inputs.reference(u, step, low, x)
    scale = (np.abs(u * np.repeat(step, GROUP, 1)) + np.abs(np.repeat(low, GROUP, 1))) @ np.abs(x).astype(np.float64)
    assert np.all(np.abs(got - want) <= (inputs + 8) * 2.0 ** -23 * scale + 1e-6)
    exact = np.zeros(rows, np.float32)
    grouped_product(tiles, tables, x, exact)
    # the input's rounding: at most half a step of each group's input, times the group's weights
    xs = np.abs(x).reshape(-1, GROUP).max(axis=1) / int16_inputs.LIMIT
    bound = (np.abs(u * np.repeat(step, GROUP, 1)).reshape(rows, -1, GROUP).sum(axis=2) * xs / 2).sum(axis=1)
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= bound + 1e-5) and err.max() > 0


def test_a_product_of_byte_tiles_or_a_float_input_stays_float():
    u, step, low, x = _layer(100, 64, levels=200)  # values past 15: a byte each
    tiles, tables = tile_groups(u, step, low)
    assert tiles.shape[1] == 64
    for rounded in (True, False):
        got, want = np.zeros(100, np.float32), np.zeros(100, np.float32)
        grouped_product(tiles, tables, x, want)
        _tiles_in_turn(tiles, tables, x, rounded, got)
        assert np.array_equal(got, want)
    u, step, low, x = _layer(100, 64)
    tiles, tables = tile_groups(u, step, low)
    got, want = np.zeros(100, np.float32), np.zeros(100, np.float32)
    grouped_product(tiles, tables, x, want)
    _tiles_in_turn(tiles, tables, x, False, got)
    assert np.array_equal(got, want)
    _tiles_in_turn(tiles, tables, x, True, got)
    assert not np.array_equal(got, want)  # two a byte and rounded: the int16 tiles


@njit(cache=False)
def _tiles_in_turn(tiles, tables, x, rounded, out):
    sums, xq, xs = int16_inputs.prepare_input(x, rounded)
    for b in range(tiles.shape[0]):
        int16_inputs.tile_product(tiles, tables, x, sums, xq, xs, out, b)
