"""numba kernels for a decode step's queries over a dense run of keys on the CPU:
:func:`dense_decode_fused`, the whole attention over keys and values in float32 or 16 bits (the
dense cache's decode), and :func:`half_scores` over keys held in 16 bits (the votes over a float16 or bfloat16
host store, ``spans``).

The references: :func:`~.dense.dense_decode_reference` for :func:`dense_decode_fused`,
``spans.vote_scores_reference`` for :func:`half_scores`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .. import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from ..prefetch import prefetch_row

# -- keys and values in float32 or as 16-bit floats' bits ------------------------------------------
# A dense layer may hold its keys as float16 and its values as bfloat16 (GrowingLayer's decode
# dtypes), handed to the kernels as their bits (int16 and uint16): widening is a shift or two and
# a product, which the compiler vectorizes, and no CPU feature is needed. The kernels take any
# of these; numba compiles one version per dtype.


@intrinsic
def _f32_bits(typingctx, x):
    """float32 -> its bits as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@intrinsic
def _f32_of_bits(typingctx, bits):
    """The low 32 bits of an integer -> the float32 they are (numba widens unsigned arithmetic to
    64 bits)."""
    if not isinstance(bits, types.Integer) or bits.bitwidth < 32:
        return None

    def codegen(context, builder, sig, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


TWO_112 = np.float32(2.0 ** 112)  # float16 bits shifted into a float32 read as the value x 2^-112


def widen(x):
    """A key or value element as float32: float32 itself; uint16, bfloat16 bits; int16, float16
    bits (sign, exponent and mantissa shifted into a float32's places read as the value times
    2^-112, so one product by 2^112 makes it exact, subnormals included)."""
    raise NotImplementedError  # numba's overload below


@overload(widen, inline="always")
def _widen(x):
    if isinstance(x, types.Integer) and not x.signed:
        return lambda x: _f32_of_bits(np.uint32(x) << np.uint32(16))  # a float32's upper half
    if isinstance(x, types.Integer):
        def half(x):
            # sign-extended and shifted, the sign lands in bit 31 and the rest in bits 13-27
            return _f32_of_bits((np.int32(x) << np.int32(13)) & np.int32(-0x70002000)) * TWO_112  # 0x8FFFE000
        return half
    return lambda x: x


def narrow(x, like):
    """float32 ``x`` as an element of an array of ``like``'s dtype, rounded to nearest, ties to
    even, as torch rounds: uint16, bfloat16 bits; int16, float16 bits (past float16's largest,
    infinity; below its smallest normal, its subnormals); float32: itself."""
    raise NotImplementedError  # numba's overload below


@overload(narrow, inline="always")
def _narrow(x, like):
    if isinstance(like, types.Integer) and not like.signed:
        def brain(x, like):
            b = _f32_bits(np.float32(x))
            return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return brain
    if isinstance(like, types.Integer):
        def half(x, like):
            b = _f32_bits(np.float32(x))
            sign = (b >> np.uint32(16)) & np.uint32(0x8000)
            a = b & np.uint32(0x7FFFFFFF)
            if a >= np.uint32(0x477FF000):  # 65520 and up round past float16's largest (NaN too)
                h = np.uint32(0x7C00) if a <= np.uint32(0x7F800000) else np.uint32(0x7E00)
            elif a < np.uint32(0x38800000):  # below 2^-14: a subnormal, in units of 2^-24
                h = np.uint32(np.rint(abs(np.float32(x)) * np.float32(2.0 ** 24)))
            else:
                a += np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))
                h = (a - np.uint32(112 << 23)) >> np.uint32(13)
            return np.int16(np.uint16(sign | h))
        return half
    return lambda x, like: np.float32(x)

# -- exp in a loop the compiler vectorizes ---------------------------------------------------------
# Without Intel's SVML, numba's np.exp is a call per element, which no loop around it vectorizes: in
# a dense decode at 8k rows the softmax's exponentials cost more than reading the keys. exp32 is
# plain arithmetic: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact to float32),
# e^r by a degree-7 polynomial (Cephes' expf coefficients: within two units in the last place),
# times 2^n made from its bits.

EXP_LOG2E = np.float32(1.4426950408889634)
EXP_LN2_HI = np.float32(0.693359375)  # ln 2's first 12 bits: n * EXP_LN2_HI is exact for |n| < 2^12
EXP_LN2_LO = np.float32(-2.12194440e-4)  # ln 2 - EXP_LN2_HI
EXP_LOWEST = np.float32(-87.33654)  # ln of float32's smallest normal: below it, 0
EXP_HIGHEST = np.float32(88.0)  # above it, e^88 (about 1.65e38; float32's largest is 3.4e38)


@njit(fastmath={"nsz", "contract", "arcp", "afn"}, cache=True)
def exp32(x):
    """e^x in float32 within two units in the last place for x in [-87.3, 88]; 0 below (results
    under float32's smallest normal flushed), e^88 above. Not reassociated (fastmath without
    ``reassoc``), so that the reduction's two steps stay in their order."""
    c = min(max(x, EXP_LOWEST), EXP_HIGHEST)
    n = np.floor(c * EXP_LOG2E + np.float32(0.5))
    r = c - n * EXP_LN2_HI
    r = r - n * EXP_LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * r * r + r + np.float32(1.0)
    two_n = _f32_of_bits(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))
    return y * two_n if x > EXP_LOWEST else np.float32(0.0)


# -- scores of one query group over a run of keys -------------------------------------------------
# torch's product of a (G, d) query group with the (n, d) keys' transpose read the keys at about
# 11 GB/s (9 ms for 3 KV heads x 131k rows, not in cache), where a sum reads 27 GB/s; scoring
# each key row against the whole group while it is in registers took 6.5 ms.


# A decode block is scored row by row, then its values are summed: the hardware's own prefetch
# left the reads short of what the memory gives. With each row's values asked for while its key
# is scored (and each key row a few rows ahead), and three queries' values summed in one pass
# (:func:`_four_rows3`), in one process, the two ways alternated, rows past the caches, 2
# threads: the embedded model's dense decode over 16-bit rows 20.6 against 18.8 GB/s at 1k rows
# (60 layers' rows) and 22.4 against 20.3 at 8k (20 layers'), faster in 10 of 10 blocks each;
# an ice layer's attention over 768 float32 resident rows with a mask 66 against 79 us a layer,
# 81 against 89 with its rows placed (120 layers' rows).
ROWS_AHEAD = 16  # rows between a key row's hint and its scoring


@njit(nogil=True, cache=True, inline="always")
def _ask_rows(kr, t, hi, vr, vt):
    """Hint key row ``t + ROWS_AHEAD`` of ``kr`` (rows first; where it is below ``hi``) and value
    row ``vt`` of ``vr`` (None: no values)."""
    if t + ROWS_AHEAD < hi:
        prefetch_row(kr, t + ROWS_AHEAD, kr.strides[0])
    if vr is not None:
        prefetch_row(vr, vt, vr.strides[0])


@njit(nogil=True, fastmath=True, cache=True)
def _score_rows(q, k, h, lo, hi, out, shift=0, kh=-1, v=None, vshift=0):
    """out[h, g, t] = q[h, g] . k[h, t] for rows lo..hi-1, a few queries of the group per pass
    over a row (:func:`_rows4`, :func:`_rows3`). ``shift``, ``kh`` (>= 0): the keys are
    ``k[kh, t + shift]`` instead (a buffer of turned rows). ``v``: the values the caller sums
    next, ``v[h, t + vshift]`` for row t: hinted as the rows are scored (None: not hinted)."""
    G = q.shape[1]
    kh = h if kh < 0 else kh
    for g0 in range(0, G, 4):
        if v is not None and g0 == 0:  # (one pass hints them; an Optional would not type)
            if G == 3:
                _rows3(q, k, h, kh, 0, lo, hi, out, shift, v[h], vshift)
            else:
                _rows4(q, k, h, kh, 0, lo, hi, out, shift, v[h], vshift)
        elif G - g0 == 3:
            _rows3(q, k, h, kh, g0, lo, hi, out, shift)
        else:
            _rows4(q, k, h, kh, g0, lo, hi, out, shift)


# Three queries a pass where three are left, not four with one repeated: the embedded model's
# groups of three scored 30 layers x 3 KV heads x 8k rows in 3.4 against 6.0 ms (two threads, a
# 2-core AVX512 machine). A repeated query costs a fourth dot product and its sum a row.


@njit(nogil=True, fastmath=True, cache=True)
def _rows4(q, k, h, kh, g0, lo, hi, out, shift, vr=None, vshift=0):
    """Queries g0 .. g0+3 of head ``h`` against rows ``k[kh, t + shift]``: scalar accumulators
    that stay in registers; where fewer than four are left, the last query is repeated and its
    copy dropped. ``vr``, ``vshift``: :func:`_ask_rows`' values."""
    G, d = q.shape[1], q.shape[2]
    g1, g2, g3 = min(g0 + 1, G - 1), min(g0 + 2, G - 1), min(g0 + 3, G - 1)
    kr = k[kh]
    for t in range(lo, hi):
        _ask_rows(kr, t + shift, hi + shift, vr, t + vshift)
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for j in range(d):
            x = widen(k[kh, t + shift, j])
            a0 += q[h, g0, j] * x
            a1 += q[h, g1, j] * x
            a2 += q[h, g2, j] * x
            a3 += q[h, g3, j] * x
        out[h, g0, t] = a0
        out[h, g1, t] = a1
        out[h, g2, t] = a2
        out[h, g3, t] = a3


@njit(nogil=True, fastmath=True, cache=True)
def _rows3(q, k, h, kh, g0, lo, hi, out, shift, vr=None, vshift=0):
    """:func:`_rows4` for exactly three queries, g0 .. g0+2."""
    d = q.shape[2]
    kr = k[kh]
    for t in range(lo, hi):
        _ask_rows(kr, t + shift, hi + shift, vr, t + vshift)
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        for j in range(d):
            x = widen(k[kh, t + shift, j])
            a0 += q[h, g0, j] * x
            a1 += q[h, g0 + 1, j] * x
            a2 += q[h, g0 + 2, j] * x
        out[h, g0, t] = a0
        out[h, g0 + 1, t] = a1
        out[h, g0 + 2, t] = a2


HALF_BLOCK = 1024  # rows per parallel task of :func:`half_scores`
HALF_TILE = 32  # rows converted to float32 at a time, then scored against every query


@njit(nogil=True, fastmath=True, cache=True)
def _half_tile(bits, h, a, m, rows):
    """Rows a .. a+m-1 of head ``h`` of 16-bit floats' bits (:func:`widen`: uint16 bfloat16,
    int16 float16) into ``rows`` (T, d) float32."""
    d = rows.shape[1]
    for i in range(m):
        for j in range(d):
            rows[i, j] = widen(bits[h, a + i, j])


@njit(parallel=True, fastmath=True, cache=True)
def half_scores(q, bits, n, brain, out):
    """``dense_scores`` over keys held in 16 bits (a host store's float16 or bfloat16 rows, as
    uint16 ``bits`` (H, >= n, d), C-contiguous; ``brain``: bfloat16): q (H, G, d) float32 ->
    out (H, G, n). One parallel region; rows converted a tile at a time as they are read. The
    reference, ``q`` times the keys converted to float32 a block at a time
    (``spans.vote_scores_reference``), took 9.8-13.4 ms per vote over a 100k float16 store and
    3 x 3 heads, this 3.2-6.0 ms (softmax included; two threads)."""
    H, G, d = q.shape
    T = HALF_TILE
    nb = (n + HALF_BLOCK - 1) // HALF_BLOCK
    halves = bits.view(np.int16)  # float16's bits as widen reads them
    for b in prange(nb * H):
        h, lo = b // nb, (b % nb) * HALF_BLOCK
        hi = min(n, lo + HALF_BLOCK)
        rows = np.empty((T, d), np.float32)
        for a in range(lo, hi, T):
            m = min(T, hi - a)
            if brain:
                _half_tile(bits, h, a, m, rows)
            else:
                _half_tile(halves, h, a, m, rows)
            for g in range(G):
                for i in range(m):
                    acc = np.float32(0.0)
                    for j in range(d):
                        acc += rows[i, j] * q[h, g, j]
                    out[h, g, a + i] = acc


# -- the whole dense decode in one call --------------------------------------------------------
# A decode step's dense attention as torch's products (seven ops a layer) cost 0.14-0.20 ms a
# layer at 256 rows and 0.26-0.30 at 1k on a 2-core AVX2 machine (3 KV heads of 3 queries each,
# d = 64), far more than the arithmetic; numba's scores with torch's softmax and value product
# above 4k rows, 1.3-2.0 ms at 8k and 4.5-5.1 at 16k. One call does scores, softmax and the value
# sum: 0.05-0.06, 0.15, 1.3 and 2.9 ms (same machine, same run). It runs in parallel over (head,
# block of rows), each block's softmax kept apart (its maximum, its sum, its weighted values) and
# the blocks joined at the end.

DECODE_ROWS = 512  # rows per parallel task of :func:`dense_decode_fused` (at most)
MIN_BLOCK = 64  # (at least)
MIN_TASKS = 4  # tasks a decode is cut into where its heads and rows allow (:func:`block_rows`)


@njit(cache=True)
def block_rows(n, H):
    """Rows per task of a decode over ``n`` rows of ``H`` KV heads: :data:`DECODE_ROWS`, fewer
    where that would give under :data:`MIN_TASKS` tasks, never under :data:`MIN_BLOCK`. One KV
    head's window of 512 rows (Gemma 3's) was one task, one thread reading it while the other
    waited: 15 such layers 2.26 against 1.42 ms in four tasks, two threads (a fixed count, not
    the thread count: the blocks, and so the sums' rounding, stay the same on every machine)."""
    tasks = (MIN_TASKS + H - 1) // H  # per head
    return max(MIN_BLOCK, min(DECODE_ROWS, (n + tasks - 1) // tasks))


def kept(valid, h, t):
    """Whether row ``t`` of head ``h`` counts: ``valid[h, t]``; every row where ``valid`` is None
    (numba compiles that case to a constant, so an unmasked block's loops stay as they were)."""
    raise NotImplementedError  # numba's overload below


@overload(kept, inline="always")
def _kept(valid, h, t):
    if isinstance(valid, types.NoneType):
        return lambda valid, h, t: True
    if valid.ndim == 1:  # one head's row of the mask (``h`` unused)
        return lambda valid, h, t: valid[t]
    return lambda valid, h, t: valid[h, t]


EMPTY = np.float32(-3.0e38)  # a block's maximum when the mask leaves it no row (its weight: 0)


def row_of(valid, h, lo, hi):
    """``valid[h, lo:hi]``; None where ``valid`` is None (:func:`kept`)."""
    raise NotImplementedError  # numba's overload below


@overload(row_of, inline="always")
def _row_of(valid, h, lo, hi):
    if isinstance(valid, types.NoneType):
        return lambda valid, h, lo, hi: None
    return lambda valid, h, lo, hi: valid[h, lo:hi]


@njit(fastmath=True, cache=True)
def _exp_row(x, scale, cap, keep):
    """One query's block of scores, in place: scaled (capped to ``cap * tanh(s / cap)`` where
    ``cap`` > 0), then each row's e^(s - m) (0 where ``keep``, a 1-D mask or None, leaves it out)
    -> (m, the sum): m the largest kept score, :data:`EMPTY` where none is. A 1-D run of float32
    with float32 factors, so that the loops vectorize (a float64 factor, or three indices a
    row, made them scalar: 0.33 against 0.06 ms a layer at 8k rows)."""
    m = EMPTY
    for i in range(x.shape[0]):
        s = x[i] * scale
        if cap > 0:
            s = np.tanh(s / cap) * cap
        x[i] = s
        if kept(keep, 0, i):
            m = max(m, s)
    acc = np.float32(0.0)
    for i in range(x.shape[0]):
        e = exp32(x[i] - m) if kept(keep, 0, i) else np.float32(0.0)
        x[i] = e
        acc += e
    return m, acc


@njit(nogil=True, fastmath=True, cache=True)
def _score_rows_placed(q, k, h, lo, hi, out, place, v=None):
    """:func:`_score_rows` where the sink and pool rows turn to their remapped places first, as
    :func:`~.kernels.place_rows` turns them (``place``: its offsets, counts, sink fill, pool
    start and rotation tables, :func:`paged_decode_fused`): the block's turned rows go to a
    buffer and are scored there, so that no copy of the layer's keys is made."""
    offset, count, sink_fill, pool_at, cos_t, sin_t, rotary = place
    d = q.shape[2]
    half = rotary // 2
    moved = min(hi, pool_at + offset.shape[1])
    if moved > lo:
        rows = np.empty((1, moved - lo, d), np.float32)
        for t in range(lo, moved):
            r = count[h] + sink_fill - 1 if t < pool_at else offset[h, t - pool_at]
            i = t - lo
            for c in range(half):
                x1 = k[h, t, c]
                x2 = k[h, t, c + half]
                rows[0, i, c] = x1 * cos_t[r, c] + (-x2) * sin_t[r, c]
                rows[0, i, c + half] = x2 * cos_t[r, c + half] + x1 * sin_t[r, c + half]
            for c in range(rotary, d):
                rows[0, i, c] = k[h, t, c]
        _score_rows(q, rows, h, lo, moved, out, -lo, 0, v, 0)
    if hi > moved:
        _score_rows(q, k, h, max(lo, moved), hi, out, 0, -1, v, 0)


@njit(fastmath=True, cache=True)
def decode_block(q, k, v, n, scale, cap, far_q, k0, c, h, b, per, scores, top, total, part, valid=None,
                 place=None, v0=None, shift=0):
    """Block ``b`` of head ``h`` in :func:`dense_decode_fused`, rows ``b * per`` on (one task; a
    caller's own parallel loop can run it): its scores, their maximum and sum of exponentials,
    its weighted values.
    ``valid`` (H, >= n) bool: the rows it leaves out weigh nothing (an empty block: maximum
    :data:`EMPTY`, sum 0; :func:`paged_decode_fused`); None: every row. ``place``: the sink and
    pool rows turn to remapped places as they are scored (:func:`_score_rows_placed`). ``v0``,
    ``shift``: see :func:`dense_decode_fused`."""
    G, d = q.shape[1], q.shape[2]
    lo, hi = b * per, min(n, (b + 1) * per)
    if place is not None:
        _score_rows_placed(q, k, h, lo, hi, scores, place, v)
    else:
        if lo < c:
            _score_rows(far_q, k0, h, lo, min(hi, c), scores)
        if hi > c:
            _score_rows(q, k, h, max(lo, c), hi, scores, shift, -1, v, shift)
    keep = row_of(valid, h, lo, hi)
    for g in range(G):
        top[h, b, g], total[h, b, g] = _exp_row(scores[h, g, lo:hi], np.float32(scale), np.float32(cap), keep)
    for j in range(d):
        for g in range(G):
            part[h, b, g, j] = 0.0
    if v0 is None:
        _sum_values(v, shift, h, b, lo, hi, scores, part, valid)
    else:
        _sum_values(v0, 0, h, b, lo, min(hi, c), scores, part, valid)
        _sum_values(v, shift, h, b, max(lo, c), hi, scores, part, valid)


@njit(nogil=True, fastmath=True, cache=True)
def _sum_values(v, shift, h, b, lo, hi, scores, part, valid):
    """part[h, b, g] += the weights ``scores[h, g, t]`` times the values ``v[h, t + shift]`` of
    rows lo..hi-1 (those ``valid`` keeps: :func:`kept`). Four rows at a time where all four
    count: their weighted values are summed before they reach ``part``, a quarter of the
    loads and stores of ``part`` a row takes one at a time (at 1k rows of 3 heads of 3 queries,
    in cache: 50 against 74 us in float32, 56 against 72 in 16 bits)."""
    G, d = part.shape[2], part.shape[3]
    t = lo
    while t < hi:
        if t + 4 <= hi and kept(valid, h, t) and kept(valid, h, t + 1) and kept(valid, h, t + 2) \
                and kept(valid, h, t + 3):
            a = t + shift
            if G == 3:
                _four_rows3(v, a, h, b, t, scores, part)
                t += 4
                continue
            if G == 4:
                _four_rows4(v, a, h, b, t, scores, part)
                t += 4
                continue
            for g in range(G):
                p0, p1 = scores[h, g, t], scores[h, g, t + 1]
                p2, p3 = scores[h, g, t + 2], scores[h, g, t + 3]
                for j in range(d):
                    part[h, b, g, j] += (p0 * widen(v[h, a, j]) + p1 * widen(v[h, a + 1, j])) + (
                        p2 * widen(v[h, a + 2, j]) + p3 * widen(v[h, a + 3, j]))
            t += 4
            continue
        if kept(valid, h, t):  # a row alone (the last rows, or a masked row among four)
            for g in range(G):
                p = scores[h, g, t]
                for j in range(d):
                    part[h, b, g, j] += p * widen(v[h, t + shift, j])
        t += 1


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _four_rows3(v, a, h, b, t, scores, part):
    """:func:`_sum_values`' four rows ``t`` .. ``t + 3`` (values ``v[h, a]`` on) for a group of
    three queries: each value widened once for the three (the general loop widens it once a
    query), the same sums in the same order. With the rows in cache, 4.1 against 7.0 ns a row
    (3 KV heads of 3 queries, d = 64, 16-bit values, one thread)."""
    d = part.shape[3]
    p00, p01, p02, p03 = scores[h, 0, t], scores[h, 0, t + 1], scores[h, 0, t + 2], scores[h, 0, t + 3]
    p10, p11, p12, p13 = scores[h, 1, t], scores[h, 1, t + 1], scores[h, 1, t + 2], scores[h, 1, t + 3]
    p20, p21, p22, p23 = scores[h, 2, t], scores[h, 2, t + 1], scores[h, 2, t + 2], scores[h, 2, t + 3]
    for j in range(d):
        w0, w1 = widen(v[h, a, j]), widen(v[h, a + 1, j])
        w2, w3 = widen(v[h, a + 2, j]), widen(v[h, a + 3, j])
        part[h, b, 0, j] += (p00 * w0 + p01 * w1) + (p02 * w2 + p03 * w3)
        part[h, b, 1, j] += (p10 * w0 + p11 * w1) + (p12 * w2 + p13 * w3)
        part[h, b, 2, j] += (p20 * w0 + p21 * w1) + (p22 * w2 + p23 * w3)


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _four_rows4(v, a, h, b, t, scores, part):
    """:func:`_four_rows3` for a group of four queries (Gemma 3's, Llama 3's)."""
    d = part.shape[3]
    p00, p01, p02, p03 = scores[h, 0, t], scores[h, 0, t + 1], scores[h, 0, t + 2], scores[h, 0, t + 3]
    p10, p11, p12, p13 = scores[h, 1, t], scores[h, 1, t + 1], scores[h, 1, t + 2], scores[h, 1, t + 3]
    p20, p21, p22, p23 = scores[h, 2, t], scores[h, 2, t + 1], scores[h, 2, t + 2], scores[h, 2, t + 3]
    p30, p31, p32, p33 = scores[h, 3, t], scores[h, 3, t + 1], scores[h, 3, t + 2], scores[h, 3, t + 3]
    for j in range(d):
        w0, w1 = widen(v[h, a, j]), widen(v[h, a + 1, j])
        w2, w3 = widen(v[h, a + 2, j]), widen(v[h, a + 3, j])
        part[h, b, 0, j] += (p00 * w0 + p01 * w1) + (p02 * w2 + p03 * w3)
        part[h, b, 1, j] += (p10 * w0 + p11 * w1) + (p12 * w2 + p13 * w3)
        part[h, b, 2, j] += (p20 * w0 + p21 * w1) + (p22 * w2 + p23 * w3)
        part[h, b, 3, j] += (p30 * w0 + p31 * w1) + (p32 * w2 + p33 * w3)


@njit(fastmath=True, cache=True)
def join_blocks(top, total, part, out):
    """The blocks' softmax parts joined: out (H, G, d)."""
    H, blocks, G, d = part.shape
    for h in range(H):
        for g in range(G):
            m = -np.inf
            for b in range(blocks):
                m = max(m, top[h, b, g])
            s = np.float32(0.0)
            for j in range(d):
                out[h, g, j] = 0.0
            for b in range(blocks):
                w = exp32(top[h, b, g] - m)
                s += total[h, b, g] * w
                for j in range(d):
                    out[h, g, j] += part[h, b, g, j] * w
            for j in range(d):
                out[h, g, j] /= s


@njit(parallel=True, fastmath=True, cache=True)
def dense_decode_fused(q, k, v, n, scale, cap, far_q, k0, c, out, v0=None, shift=0):
    """softmax(scores) v over rows 0..n-1, scores = ``scale * q . k`` (capped to ``cap *
    tanh(s / cap)`` where ``cap`` > 0): q (H, G, d); k, v (H, >= n, d) C-contiguous, float32 or
    16-bit floats' bits (:func:`widen`); out (H, G, d).
    The first ``c`` rows score ``far_q . k0`` instead (a clamped distance,
    :meth:`~.dense.GrowingLayer.clamped`; far_q (H, G, d), k0 (H, >= c, d)). The reference is
    :func:`~.dense.dense_decode_reference`. ``v0`` (H, >= c, d): those rows' values too (another
    run of rows: a remapped dense layer's sink, :class:`~.positions.RemapDenseLayer`); the rows
    from ``c`` on are then ``k[h, t + shift]``, ``v[h, t + shift]`` (its window)."""
    H, G, d = q.shape
    per = block_rows(n, H)
    blocks = max(1, (n + per - 1) // per)
    scores = np.empty((H, G, n), np.float32)
    top = np.empty((H, blocks, G), np.float32)
    total = np.empty((H, blocks, G), np.float32)
    part = np.empty((H, blocks, G, d), np.float32)
    for task in prange(H * blocks):
        decode_block(q, k, v, n, scale, cap, far_q, k0, c, task // blocks, task % blocks, per, scores, top, total,
                     part, None, None, v0, shift)
    join_blocks(top, total, part, out)


# -- an ice layer's decode attention over its resident rows -------------------------------------
# torch's SDPA with a boolean mask over an ice layer's resident rows (sink, pool, window; 3 KV
# heads of 3 queries, d = 64) took 0.20 / 0.30 ms a layer at 336 / 600 rows on a 2-core AVX2
# machine, where this kernel with its wrapper takes 0.16 / 0.23 (28 layers' rows in turn, medians
# of 20). The dense decode's blocks, the rows the mask leaves out weighing nothing.


@njit(parallel=True, fastmath=True, cache=True)
def paged_decode_fused(q, k, v, valid, scale, cap, out, place=None, rest_q=None, groups=None):
    """softmax(scores) v over the rows ``valid`` (H, L) allows, scores = ``scale * q . k``
    (capped to ``cap * tanh(s / cap)`` where ``cap`` > 0): q (H, G, d); k, v (H, L, d)
    float32; out (H, G, d). Every head needs a valid row. The reference is
    :func:`~.paged.paged_decode_reference`. ``place`` (offset (H, P) int64, count (H,) int64,
    sink fill, pool start, cos and sin tables (R, rotary) float32, rotary): the keys as
    :func:`~.kernels.place_rows` would place them (remapped positions), without the copy; the
    reference is :func:`~.positions.place_keys` then :func:`~.paged.paged_decode_reference`.

    ``groups`` (``rest_estimate``'s rows, :mod:`.rest`): two groups of estimate rows in the same
    softmax, each (keys transposed (H, d, >= n), values (H, >= n, d), bias (H, >= n), n), its
    first ``n`` rows scored ``scale * rest_q . key`` (capped) plus the bias (-inf: left out);
    ``rest_q`` (H, G, d) their query. The reference is :func:`~.paged.paged_decode_rest_reference`."""
    H, G, d = q.shape
    n = k.shape[1]
    per = block_rows(n, H)
    blocks = max(1, (n + per - 1) // per)
    per1, n1, per2, n2 = rest_split(groups, H)
    b1 = (n1 + per1 - 1) // per1
    every = blocks + b1 + (n2 + per2 - 1) // per2
    scores = np.empty((H, G, n), np.float32)
    top = np.empty((H, every, G), np.float32)
    total = np.empty((H, every, G), np.float32)
    part = np.empty((H, every, G, d), np.float32)
    for task in prange(H * every):
        h, b = task // every, task % every
        if b < blocks:
            decode_block(q, k, v, n, scale, cap, q, k, 0, h, b, per, scores, top, total, part, valid, place)
        elif b < blocks + b1:
            rest_block(rest_q, groups, 0, h, b, (b - blocks) * per1, min(n1, (b - blocks + 1) * per1), scale, cap,
                       top, total, part)
        else:
            lo = (b - blocks - b1) * per2
            rest_block(rest_q, groups, 1, h, b, lo, min(n2, lo + per2), scale, cap, top, total, part)
    join_blocks(top, total, part, out)


# -- estimate rows beside the resident ones (``rest_estimate``) -------------------------------------
# Gemma 3's global layers at 32k (one KV head, about 2500 tree pages) took 2-3 ms a layer through
# torch's products over the estimate rows (:func:`~.paged.paged_decode_rest`) and the placed copy
# of the keys; the estimate rows are blocks of the same parallel softmax here.


def rest_split(groups, H):
    """(rows per task, rows) of each of the two estimate groups (none: zero rows)."""
    raise NotImplementedError  # numba's overload below


@overload(rest_split, inline="always")
def _rest_split(groups, H):
    if isinstance(groups, types.NoneType):
        return lambda groups, H: (1, 0, 1, 0)
    return lambda groups, H: (block_rows(groups[3], H), groups[3], block_rows(groups[7], H), groups[7])


def rest_block(rest_q, groups, which, h, b, lo, hi, scale, cap, top, total, part):
    """Rows lo..hi-1 of estimate group ``which`` as block ``b`` of head ``h``
    (:func:`_rest_rows`); nothing without groups."""
    raise NotImplementedError  # numba's overload below


@overload(rest_block, inline="always")
def _rest_block(rest_q, groups, which, h, b, lo, hi, scale, cap, top, total, part):
    if isinstance(groups, types.NoneType):
        return lambda rest_q, groups, which, h, b, lo, hi, scale, cap, top, total, part: None

    def both(rest_q, groups, which, h, b, lo, hi, scale, cap, top, total, part):
        if which == 0:
            _rest_rows(rest_q, groups[0], groups[1], groups[2], h, b, lo, hi, scale, cap, top, total, part)
        else:
            _rest_rows(rest_q, groups[4], groups[5], groups[6], h, b, lo, hi, scale, cap, top, total, part)
    return both


# -inf biases are read (a left-out row), so no "no infinities" flag here
NO_INF_MATH = {"nsz", "contract", "arcp", "afn", "reassoc"}
LEFT_OUT = np.float32(-1.0e30)  # a bias at or below this: the row is left out (-inf)


@njit(nogil=True, fastmath=NO_INF_MATH, cache=True)
def _rest_rows(rq, kt, vals, bias, h, b, lo, hi, scale, cap, top, total, part):
    """Block ``b`` of head ``h`` over estimate rows lo..hi-1 (keys transposed ``kt`` (H, d, .),
    values ``vals`` (H, ., d), ``bias`` (H, .)): their scores against ``rq`` (H, G, d), summed
    along the rows (a column of the transposed keys is contiguous), the block's maximum, sum of
    exponentials and weighted values, as :func:`decode_block` leaves them. The loops run over
    one-dimensional views: indexed through the 3-D arrays the same loops did not vectorize
    (275 against 86 us for 512 rows of 256 channels and 4 queries, in cache)."""
    G, d = rq.shape[1], rq.shape[2]
    m = hi - lo
    e = np.zeros((G, max(m, 1)), np.float32)
    for j in range(d):
        column = kt[h, j, lo:hi]
        for g in range(G):
            x = rq[h, g, j]
            row = e[g]
            for i in range(m):
                row[i] += x * column[i]
    near = bias[h, lo:hi]
    for g in range(G):
        row = e[g]
        best = EMPTY
        for i in range(m):
            s = row[i] * scale
            if cap > 0:
                s = np.tanh(s / cap) * cap
            c = near[i]
            s = s + c if c > LEFT_OUT else EMPTY
            row[i] = s
            best = max(best, s)
        acc = np.float32(0.0)
        for i in range(m):
            w = exp32(row[i] - best) if row[i] > EMPTY else np.float32(0.0)
            row[i] = w
            acc += w
        top[h, b, g], total[h, b, g] = best, acc
        sums = part[h, b, g]
        for j in range(d):
            sums[j] = 0.0
    for i in range(m):
        value = vals[h, lo + i]
        for g in range(G):
            w = e[g, i]
            if w > 0:
                sums = part[h, b, g]
                for j in range(d):
                    sums[j] += w * value[j]


@njit(cache=True)
def turn_queries(q, src, dst, inv, rotary):
    """``q`` (H, G, d) float32 turned from position ``src`` to ``dst`` by the RoPE frequencies
    ``inv`` (rotary / 2,): a copy; the angles as :meth:`~.positions.RopeFrame.rotate` takes them
    (each position's float32 angle, their difference in float64), which is its reference."""
    H, G, d = q.shape
    half = rotary // 2
    out = q.copy()
    for c in range(half):
        delta = np.float64(np.float32(dst) * inv[c]) - np.float64(np.float32(src) * inv[c])
        co, si = np.float32(np.cos(delta)), np.float32(np.sin(delta))
        for h in range(H):
            for g in range(G):
                a, z = q[h, g, c], q[h, g, c + half]
                out[h, g, c] = a * co - z * si
                out[h, g, c + half] = z * co + a * si
    return out
