"""A decode step's 4-bit products with the input rounded to int16: the sums in integers.

:func:`~icecache.int8_rows.grouped_tile` multiplies each 4-bit weight (a nibble, two a byte) by a
float32 input: per weight a widening to float, an unpacking and a multiply-add, which on a 2-core
AVX2 CPU leaves the embedded model's products bound by arithmetic (about 7 GB/s of weights, a
third of what the memory reads). Here the input is rounded per group of 32 to int16 (a step
``max|x| / 32767`` a group, :func:`quantize_input`) and a group's sums over 64 rows are integer:
each byte's two nibbles side by side as 16-bit words, and on x86 with AVX2 ``vpmaddwd`` multiplies
16 of them by 16 inputs and adds them in pairs (at most 2 * 15 * 32767 a pair, 16 pairs a group:
no overflow in 32 bits). Elsewhere the same sums come from plain vector arithmetic
(:func:`_madd_pairs`), exact all the same. A row's result is then ``sum_g step_g * xs_g * isum_g +
low_g * sum_g(x)``: only the input's rounding differs from the float product (the minimums'
group sums stay float), about 2-5e-5 of a product's largest output.

Rounding to int8 instead (llama.cpp's Q8 inputs, one ``vpmaddubsw`` for 32 weights) made the
products 2.3-2.6x faster than float, but moved them by 0.5-1% of their largest output, and the
embedded model's teacher-forced tokens agreed with the float model's 60 times in 64 (KL 0.0093,
against 64 / 64 and 0.0003 in float): not kept.

References: :func:`reference` (the same rounding, then float64 sums) for :func:`int16_product`;
:func:`~icecache.int8_rows.grouped_product` for the float product it stands in for.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic

from . import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from .int8_rows import BLOCK, GROUP, group_sums, grouped_tile

LIMIT = 32767  # the rounded input's largest magnitude
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_BYTES, _WORDS, _LONGS = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)


def _host_has(feature: str) -> bool:
    """Whether numba compiles for a host CPU with ``feature`` (its own target, not one set by
    ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``)."""
    if numba_config.CPU_NAME or numba_config.CPU_FEATURES:
        return False
    import llvmlite.binding as llvm

    return bool(llvm.get_host_cpu_features().get(feature, False))


def avx2() -> bool:
    """Whether numba compiles for a host CPU with AVX2: then :func:`group_isums` uses
    ``vpmaddwd``."""
    return _host_has("avx2")


def avx512() -> bool:
    """Whether numba compiles for a host CPU with AVX-512 BW: then :func:`group_isums` uses
    ``vpmaddwd`` on 512-bit registers (:func:`_madd_pairs`)."""
    return _host_has("avx512bw")


def _consts(t: ir.Type, values) -> ir.Constant:
    values = list(values)
    return ir.Constant(ir.VectorType(t, len(values)), [ir.Constant(t, v) for v in values])


_WORDS32, _LONGS16 = ir.VectorType(_I16, 32), ir.VectorType(_I32, 16)


def _madd_pairs(builder: ir.IRBuilder, weights: ir.Value, inputs: ir.Value, fast: bool) -> ir.Value:
    """(n int16, n int16) -> n / 2 int32, n 16 or 32: ``w[2i] * x[2i] + w[2i + 1] * x[2i + 1]``.
    ``fast``: ``vpmaddwd`` (AVX2's on 16 words, AVX-512 BW's on 32); else the same by widened
    products."""
    n = weights.type.count
    if fast:
        words, longs = (_WORDS, _LONGS) if n == 16 else (_WORDS32, _LONGS16)
        name = "llvm.x86.avx2.pmadd.wd" if n == 16 else "llvm.x86.avx512.pmaddw.d.512"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(longs, [words, words]), name)
        return builder.call(fn, [weights, inputs])
    wide = ir.VectorType(_I32, n)
    prod = builder.mul(builder.sext(weights, wide), builder.sext(inputs, wide))
    even = builder.shuffle_vector(prod, prod, _consts(_I32, range(0, n, 2)))
    odd = builder.shuffle_vector(prod, prod, _consts(_I32, range(1, n, 2)))
    return builder.add(even, odd)


def _repeat_pair(builder: ir.IRBuilder, pair: ir.Value) -> ir.Value:
    """An int32 holding two int16 values -> the pair repeated eight times as 16 int16 words: the
    other operand of :func:`_madd_pairs` for one pair of inputs against eight rows."""
    xs = builder.insert_element(ir.Constant(_LONGS, ir.Undefined), pair, ir.Constant(_I32, 0))
    return builder.bitcast(builder.shuffle_vector(xs, xs, _consts(_I32, [0] * 8)), _WORDS)


def _item_pointer(context, builder, aty, arr, indices, index_types):
    ary = context.make_array(aty)(context, builder, arr)
    idx = [context.cast(builder, v, t, types.intp) for v, t in zip(indices, index_types, strict=True)]
    return cgutils.get_item_pointer(context, builder, aty, ary, idx, wraparound=False)


@intrinsic
def group_isums(typingctx, tiles, b, j0, xq, x0, out):
    """``group_isums(tiles, b, j0, xq, x0, out)`` in a kernel: ``out[r]`` (int32, 64 rows) =
    the sum over the 16 bytes ``j = j0 .. j0 + 15`` of tile ``b`` (``tiles`` (tiles, inputs / 2,
    64) uint8, C order: :func:`~icecache.int8_rows.tile_groups`' two values a byte) of
    ``low(tiles[b, j, r]) * xq[x0 + 2i] + high(tiles[b, j, r]) * xq[x0 + 2i + 1]``, ``i = j - j0``:
    one group of 32 int16 inputs against 64 rows, in registers (the caller keeps to the bounds)."""
    if not (isinstance(tiles, types.Array) and tiles.dtype == types.uint8 and tiles.ndim == 3
            and isinstance(xq, types.Array) and xq.dtype == types.int16 and isinstance(out, types.Array)
            and out.dtype == types.int32):
        return None
    sig = types.void(tiles, b, j0, xq, x0, out)
    fast, wide = avx2(), avx512()

    def codegen(context, builder, signature, args):
        tty, bty, jty, xty, x0ty, oty = signature.args
        zero = context.get_constant(types.intp, 0)
        w0 = _item_pointer(context, builder, tty, args[0], [args[1], args[2], zero], [bty, jty, types.intp])
        x_pairs = builder.bitcast(_item_pointer(context, builder, xty, args[3], [args[4]], [x0ty]), _I32.as_pointer())
        dst = _item_pointer(context, builder, oty, args[5], [zero], [types.intp])
        low4, shift4 = _consts(_I8, [15] * 32), _consts(_I8, [4] * 32)
        # a row's two values side by side: bytes [low_r, high_r] for rows 0-15, then rows 16-31
        orders = (_consts(_I32, [i // 2 + (32 if i % 2 else 0) for i in range(32)]),
                  _consts(_I32, [16 + i // 2 + (32 if i % 2 else 0) for i in range(32)]))
        halves = (_consts(_I32, range(16)), _consts(_I32, range(16, 32)))
        # with AVX-512 BW a part's 16 rows in one 512-bit vpmaddwd, else two 256-bit ones
        per = 16 if wide else 8
        vector = _LONGS16 if wide else _LONGS
        longs = [ir.Constant(vector, None)] * (64 // per)  # rows 0 .. per - 1, per .. 2 per - 1, ...
        for j in range(16):
            pair = builder.load(builder.gep(x_pairs, [ir.Constant(_I32, j)]), align=2)  # (x_2j, x_2j+1)
            xs = _repeat_pair(builder, pair)
            if wide:
                xs = builder.shuffle_vector(xs, xs, _consts(_I32, [i % 16 for i in range(32)]))
            for h in range(2):  # rows 0-31, 32-63
                at = builder.gep(w0, [ir.Constant(_I32, j * BLOCK + 32 * h)])
                w = builder.load(builder.bitcast(at, _BYTES.as_pointer()), align=1)
                lo, hi = builder.and_(w, low4), builder.and_(builder.lshr(w, shift4), low4)
                for part, order in enumerate(orders):
                    words = builder.zext(builder.shuffle_vector(lo, hi, order), ir.VectorType(_I16, 32))
                    if wide:
                        k = 2 * h + part
                        longs[k] = builder.add(longs[k], _madd_pairs(builder, words, xs, True))
                        continue
                    for q, half in enumerate(halves):
                        k = 4 * h + 2 * part + q
                        got = _madd_pairs(builder, builder.shuffle_vector(words, words, half), xs, fast)
                        longs[k] = builder.add(longs[k], got)
        for k in range(64 // per):
            at = builder.gep(dst, [ir.Constant(_I32, per * k)])
            builder.store(longs[k], builder.bitcast(at, vector.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def quantize_input(x, xq, xs):
    """The input ``x`` (k,) float32 rounded per group of :data:`GROUP`: ``xs[g] = max|x| / LIMIT``
    over the group and ``xq = round(x * LIMIT / max|x|)`` int16 (a group of zeros: step 0,
    values 0). Without fastmath: the rounding is :func:`reference`'s to the last bit."""
    for g in range(x.shape[0] // GROUP):
        top = np.float32(0.0)
        for j in range(g * GROUP, (g + 1) * GROUP):
            top = max(top, abs(x[j]))
        xs[g] = top / np.float32(LIMIT)
        inv = np.float32(LIMIT) / top if top > 0 else np.float32(0.0)
        for j in range(g * GROUP, (g + 1) * GROUP):
            xq[j] = np.int16(min(max(np.round(x[j] * inv), -LIMIT), LIMIT))


NO_INPUT = np.zeros(0, np.int16)  # an input not rounded: the float product


@njit(fastmath=True, cache=True)
def prepare_input(x, rounded):
    """What a product of ``x`` needs: its group sums, and where ``rounded``, its int16 values and
    steps (:func:`quantize_input`; else empty: the float product)."""
    sums = group_sums(x)
    if not rounded:
        return sums, NO_INPUT, np.zeros(0, np.float32)
    xq = np.empty(x.shape[0], np.int16)
    xs = np.empty(x.shape[0] // GROUP, np.float32)
    quantize_input(x, xq, xs)
    return sums, xq, xs


@njit(fastmath=True, cache=True)
def int16_tile(tiles, tables, xq, xs, sums, out, b):
    """Tile ``b`` of a product of two-a-byte tiles (:func:`~icecache.int8_rows.tile_groups`) with
    an int16 input (:func:`quantize_input`): per group the integer sums of :func:`group_isums`,
    scaled by the weights' step and the input's, plus the minimums times the float group sums."""
    n = out.shape[0]
    total = np.zeros(BLOCK, np.float32)
    isum = np.empty(BLOCK, np.int32)
    for g in range(xq.shape[0] // GROUP):
        group_isums(tiles, b, g * (GROUP // 2), xq, g * GROUP, isum)
        a, s = xs[g], sums[g]
        for r in range(BLOCK):
            total[r] += tables[b, g, 0, r] * (a * np.float32(isum[r])) + tables[b, g, 1, r] * s
    for r in range(min(BLOCK, n - b * BLOCK)):
        out[b * BLOCK + r] = total[r]


@njit(fastmath=True, cache=True)
def tile_product(tiles, tables, x, sums, xq, xs, out, b):
    """Tile ``b`` of a layer's product: by :func:`int16_tile` where the input was rounded
    (:func:`prepare_input`) and the tiles hold two values a byte, else by the float
    :func:`~icecache.int8_rows.grouped_tile`."""
    if xq.shape[0] and 2 * tiles.shape[1] == x.shape[0]:
        int16_tile(tiles, tables, xq, xs, sums, out, b)
    else:
        grouped_tile(tiles, tables, x, sums, out, b)


@njit(parallel=True, fastmath=True, cache=True)
def int16_product(tiles, tables, x, out):
    """out = the product of :func:`~icecache.int8_rows.grouped_product` with ``x`` rounded to
    int16 (two-a-byte tiles), a tile per task."""
    sums, xq, xs = prepare_input(x, True)
    for b in prange(tiles.shape[0]):
        int16_tile(tiles, tables, xq, xs, sums, out, b)


def reference(u: np.ndarray, step: np.ndarray, low: np.ndarray, x: np.ndarray) -> np.ndarray:
    """:func:`int16_product` in plain NumPy: (rows, inputs) values 0..15, (rows, groups) steps and
    minimums, the input (inputs,) -> float64 sums of the weights times the input as
    :func:`quantize_input` rounds it, plus the minimums times the float input's group sums."""
    g = x.astype(np.float32).reshape(-1, GROUP)
    top = np.abs(g).max(axis=1)
    xs = (top / np.float32(LIMIT)).astype(np.float32)
    inv = np.where(top > 0, np.float32(LIMIT) / np.where(top > 0, top, 1), 0).astype(np.float32)
    xq = np.clip(np.round(g * inv[:, None]), -LIMIT, LIMIT)
    isums = (u.astype(np.float64).reshape(u.shape[0], -1, GROUP) * xq[None]).sum(axis=2)  # (rows, groups)
    return (step.astype(np.float64) * xs[None].astype(np.float64) * isums).sum(axis=1) \
        + (low.astype(np.float64) * g.astype(np.float64).sum(axis=1)[None]).sum(axis=1)
