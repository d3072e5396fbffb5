"""A shared walk's scores from the int8 copy of the keys, summed in integers (``walk_keys: int8``).

The walk scores a page's keys against each of a GQA group's queries. Scored in float (each key
element widened to float, a multiply-add per query, a horizontal sum per key and query) a page of
16 keys took about 14 ns a key on a 2-core AVX2 CPU, half of a walk's time with warm caches. Here the
query is rounded to int16 (a step ``max|q| / 32767`` of its own, :func:`round_queries`) and the
copy is laid out by pairs of coordinates, ``(pages, ceil(d / 2), rows, 2)`` with ``rows`` the page
size rounded up to :data:`BLOCK`: for a pair of coordinates, eight keys' two values side by side
are 16 bytes, which widen to sixteen int16 words, and AVX2's ``vpmaddwd`` multiplies them by the
query's pair (repeated eight times) and adds each key's two products: eight keys' partial sums in
one instruction, with no horizontal sum at the end (:func:`block_sums`). Elsewhere the same sums
come from plain vector arithmetic (``int16_inputs._madd_pairs``), exact all the same. Scanning
148 pages of 16 keys against three queries with warm caches: 20-24 against 38-42 us.

Each query's sums add up in two accumulators, the even pairs' and the odd pairs', added at the
end: with one, a query's 32 products (d = 64) were one chain of dependent adds, and the group's
three or four chains, not the multiply-adds, set the pace. With warm caches on an AVX-512 CPU
(which fuses the multiply and the add into ``vpdpwssd``): 10.3 -> 8.6 ns a key for three queries
at d = 64, 23.2 -> 14.2 at d = 256 (Gemma 3's keys). The partial sums are sums of fewer products,
so they stay within the bound below; the result is the same integer.

A sum is at most ``d * 127 * 32767``, under 2^31 up to :data:`MAX_DIM`, so it is exact (a tree
of wider keys walks its float keys instead: ``DCITree._int8_walk``); a score
is ``float32(sum) * key step * query step``: against the float key copy only the query's rounding
differs, a relative 1.5e-5 of its largest coordinate. Reference: :func:`reference_sums`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ... import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from ...int16_inputs import _I8, _I16, _I32, _LONGS, LIMIT, _item_pointer, _madd_pairs, _repeat_pair, avx2

BLOCK = 8  # keys summed together: the eight int32 lanes of one ``vpmaddwd`` (int16_inputs._LONGS)
MAX_DIM = 512  # the widest key whose integer sums cannot overflow int32
MAX_GROUP = 4  # queries one block_sums call takes (eight accumulators of eight lanes)


def pair_rows(page_size: int) -> int:
    """Rows a page of the pair copy holds: ``page_size`` rounded up to :data:`BLOCK`."""
    return -(-page_size // BLOCK) * BLOCK


def _block_sums_of(nq: int):
    """:func:`block_sums` for ``nq`` queries (1 to :data:`MAX_GROUP`): its accumulators are
    unrolled, so each group size is an intrinsic of its own."""

    @intrinsic
    def sums(typingctx, keys, pg, b, q, g0, out):
        if not (isinstance(keys, types.Array) and keys.dtype == types.int8 and keys.ndim == 4
                and isinstance(q, types.Array) and q.dtype == types.int16 and q.ndim == 3
                and isinstance(out, types.Array) and out.dtype == types.int32 and out.ndim == 2):
            return None
        sig = types.void(keys, pg, b, q, g0, out)
        fast = avx2()

        def codegen(context, builder, signature, args):
            kty, pty, bty, qty, gty, oty = signature.args
            zero = context.get_constant(types.intp, 0)
            intp = types.intp
            karr = context.make_array(kty)(context, builder, args[0])
            pairs = cgutils.unpack_tuple(builder, karr.shape, 4)[1]
            row0 = builder.mul(context.cast(builder, args[2], bty, intp), context.get_constant(intp, BLOCK))
            first = _item_pointer(context, builder, kty, args[0], [args[1], zero, row0, zero], [pty, intp, intp, intp])
            first = builder.bitcast(first, ir.VectorType(_I8, 2 * BLOCK).as_pointer())
            # bytes from one pair of coordinates to the next: a page row of pairs
            stride = cgutils.unpack_tuple(builder, karr.strides, 4)[1]
            g0 = context.cast(builder, args[4], gty, intp)
            qpairs = [builder.bitcast(_item_pointer(context, builder, qty, args[3],
                                                    [builder.add(g0, context.get_constant(intp, r)), zero, zero],
                                                    [intp, intp, intp]), _I32.as_pointer())
                      for r in range(nq)]
            # two accumulators a query, the even pairs' and the odd pairs': each chain of
            # dependent adds half as long
            acc_zero = ir.Constant(_LONGS, [ir.Constant(_I32, 0)] * BLOCK)
            accs = [[cgutils.alloca_once_value(builder, acc_zero) for _ in range(2)] for _ in range(nq)]
            byte = ir.IntType(8).as_pointer()

            def add_pair(j, a):
                at = builder.gep(builder.bitcast(first, byte), [builder.mul(j, stride)])
                words = builder.sext(builder.load(builder.bitcast(at, first.type), align=1),
                                     ir.VectorType(_I16, 2 * BLOCK))
                for r in range(nq):
                    pair = builder.load(builder.gep(qpairs[r], [j]), align=2)
                    xs = _repeat_pair(builder, pair)
                    acc = accs[r][a]
                    builder.store(builder.add(builder.load(acc), _madd_pairs(builder, words, xs, fast)), acc)

            one = context.get_constant(intp, 1)
            with cgutils.for_range(builder, builder.lshr(pairs, one)) as loop:
                j = builder.shl(loop.index, one)
                add_pair(j, 0)
                add_pair(builder.add(j, one), 1)
            with builder.if_then(builder.trunc(pairs, ir.IntType(1))):
                add_pair(builder.sub(pairs, one), 0)
            dst = _item_pointer(context, builder, oty, args[5], [zero, zero], [intp, intp])
            ostride = cgutils.unpack_tuple(builder, context.make_array(oty)(context, builder, args[5]).strides, 2)[0]
            for r in range(nq):
                at = builder.gep(builder.bitcast(dst, byte), [builder.mul(context.get_constant(intp, r), ostride)])
                total = builder.add(builder.load(accs[r][0]), builder.load(accs[r][1]))
                builder.store(total, builder.bitcast(at, _LONGS.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return sums


_sums1, _sums2, _sums3, _sums4 = (_block_sums_of(n) for n in range(1, MAX_GROUP + 1))


@njit(nogil=True, cache=True, inline="always")
def block_sums(keys, pg, b, q, g0, nq, out):
    """``out[r, i]`` (int32, rows ``r < nq``, ``i <`` :data:`BLOCK`) = the integer dot product of
    key ``BLOCK * b + i`` of page ``pg`` of the pair copy ``keys`` ((pages, pairs, rows, 2) int8,
    C order) with query ``g0 + r`` of ``q`` ((queries, pairs, 2) int16, C order), for ``nq`` of 1
    to :data:`MAX_GROUP` queries. ``out`` is (at least :data:`MAX_GROUP`, :data:`BLOCK`) int32 with
    its rows contiguous; the caller keeps to the bounds."""
    if nq >= 4:
        _sums4(keys, pg, b, q, g0, out)
    elif nq == 3:
        _sums3(keys, pg, b, q, g0, out)
    elif nq == 2:
        _sums2(keys, pg, b, q, g0, out)
    else:
        _sums1(keys, pg, b, q, g0, out)


@njit(nogil=True, cache=True)
def round_queries(V, pairs):
    """The unit queries ``V`` (g, d) float32 rounded to int16 for :func:`block_sums`: (g, pairs, 2)
    with the last pair's second value 0 for an odd ``d``, and each query's step ``max|q| /
    32767`` (1 for a zero query). Without fastmath: :func:`reference_sums`' rounding to the bit."""
    g, d = V.shape
    q = np.zeros((g, pairs, 2), np.int16)
    steps = np.empty(g, np.float32)
    for r in range(g):
        top = np.float32(0.0)
        for j in range(d):
            top = max(top, abs(V[r, j]))
        steps[r] = top / np.float32(LIMIT) if top > 0 else np.float32(1.0)
        inv = np.float32(LIMIT) / top if top > 0 else np.float32(0.0)
        for j in range(d):
            q[r, j // 2, j % 2] = np.int16(min(max(np.round(V[r, j] * inv), -LIMIT), LIMIT))
    return q, steps


def reference_sums(keys: np.ndarray, q: np.ndarray) -> np.ndarray:
    """:func:`block_sums` of every key of every page at once, in int64 NumPy: (pages, rows,
    queries) from the pair copy ``keys`` (pages, pairs, rows, 2) and ``q`` (queries, pairs, 2)."""
    return np.einsum("pjst,gjt->psg", keys.astype(np.int64), q.astype(np.int64))
