"""numba kernels of the caches: plan one KV head's page loads for a decode step (and the whole
load in one call); the packing of chosen tokens into pages; the remapped positions' offsets and
key placement. A decode step's scores over a long dense run of keys are in :mod:`.score_kernels`.

The plain references are :func:`plan_head_reference` (NumPy, the same contract; the tests compare
the two on random pool states) and the NumPy or torch versions each kernel's docstring names.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from ..prefetch import prefetch_row
from .score_kernels import _f32_bits, paged_decode_fused, turn_queries


@njit(nogil=True, cache=True)
def plan_head(want, slot_page, slot_version, slot_fill, version, members, count, row0, dst0, S,
              valid, src_out, dst_out, m):
    """Keep the wanted pages already resident (same version), put the others into free slots.

    ``want``: pages to have resident; ``slot_*``: this head's pool slots (updated in place);
    ``version``: the page versions of the tree holding the pages; ``members``/``count``: that
    tree's pages. ``row0``: this head's first host-store row; ``dst0``: its first pool row.
    Host rows to copy are appended to ``src_out``/``dst_out`` from ``m`` on; ``valid``: this
    head's pool validity rows (P * S), rewritten. Returns (new m, pages loaded).
    """
    P = slot_page.shape[0]
    inuse = np.zeros(P, np.bool_)
    missing = np.empty(want.shape[0], np.int64)
    nmiss = 0
    for j in range(want.shape[0]):
        p = want[j]
        found = False
        for s in range(P):
            if slot_page[s] == p and slot_version[s] == version[p] and not inuse[s]:
                inuse[s] = True
                found = True
                break
        if not found:
            missing[nmiss] = p
            nmiss += 1
    s = 0
    for j in range(nmiss):
        while inuse[s]:
            s += 1
        p = missing[j]
        c = count[p]
        for t in range(c):
            src_out[m] = row0 + members[p, t]
            dst_out[m] = dst0 + s * S + t
            m += 1
        slot_page[s] = p
        slot_version[s] = version[p]
        slot_fill[s] = c
        inuse[s] = True
    for s in range(P):
        for t in range(S):
            valid[s * S + t] = inuse[s] and t < slot_fill[s]
    return m, nmiss


def plan_head_reference(want, slot_page, slot_version, slot_fill, version, members, count, row0,
                        dst0, S):
    """NumPy/Python version of :func:`plan_head`: returns (src rows, dst rows, valid, loaded)."""
    P = len(slot_page)
    inuse = np.zeros(P, bool)
    missing = []
    for p in want:
        hits = [s for s in range(P) if slot_page[s] == p and slot_version[s] == version[p] and not inuse[s]]
        if hits:
            inuse[hits[0]] = True
        else:
            missing.append(int(p))
    src, dst = [], []
    free = [s for s in range(P) if not inuse[s]]
    for p, s in zip(missing, free, strict=False):
        c = int(count[p])
        src += [row0 + int(x) for x in members[p, :c]]
        dst += [dst0 + s * S + t for t in range(c)]
        slot_page[s], slot_version[s], slot_fill[s] = p, version[p], c
        inuse[s] = True
    valid = (inuse[:, None] & (np.arange(S)[None, :] < slot_fill[:, None])).reshape(-1)
    return np.array(src, np.int64), np.array(dst, np.int64), valid, len(missing)


# -- a decode step's page loads on the CPU in one call ----------------------------------------------
def widening_table(dtype: str) -> np.ndarray:
    """Every 16-bit pattern's float32 value, as its bits (65536 uint32), for ``dtype`` "float16"
    or "bfloat16", by NumPy's own conversion: the reference :func:`widen_bits` is tested against
    on every pattern."""
    bits = np.arange(65536, dtype=np.uint32)
    if dtype == "bfloat16":
        return bits << np.uint32(16)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)


# the host store's element types :func:`load_pool` widens (``kind``): float32 (copied as it is),
# bfloat16 and float16, each read as its bits
FLOAT32, BFLOAT16, FLOAT16 = 0, 1, 2


@njit(inline="always")
def half_bits(x):
    """A float16's bits (the low 16 of ``x``) -> the bits of the same value as a float32,
    exactly as NumPy widens it: subnormals, signed zeros, infinities and NaN payloads included.
    A few integer operations and two selects, which the compiler vectorizes (a look-up in a
    65536-entry table is a gather per element: the loads of a 16k decode step took 24-43% less
    time in :func:`load_pool` this way, docs/results.md)."""
    h = np.uint32(x) & np.uint32(0xFFFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    mag = h & np.uint32(0x7FFF)
    shifted = mag << np.uint32(13)
    normal = shifted + np.uint32(0x38000000)  # the exponent rebased: (127 - 15) << 23
    special = shifted | np.uint32(0x7F800000)  # infinity or NaN (its payload kept)
    tiny = _f32_bits(np.float32(mag) * np.float32(2.0 ** -24))  # zero or subnormal: mag units of 2^-24, exact
    out = normal if mag >= np.uint32(0x0400) else tiny
    out = special if mag >= np.uint32(0x7C00) else out
    return sign | out


@njit(inline="always")
def widened(x, kind):
    """One host-store element's bits -> its float32 value's bits, for the element type ``kind``
    (:data:`FLOAT32`: the bits themselves; :data:`BFLOAT16`: a float32's upper half;
    :data:`FLOAT16`: :func:`half_bits`). ``kind`` is the same for a whole loop, which the
    compiler then splits by it."""
    if kind == FLOAT16:
        return half_bits(x)
    if kind == BFLOAT16:
        return np.uint32(x) << np.uint32(16)
    return np.uint32(x)


@njit(nogil=True, cache=True)
def widen_bits(x, kind):
    """:func:`widened` over an array (uint32 out): what :func:`load_pool` does to each element
    of a row it loads, as a function its test calls on every 16-bit pattern."""
    out = np.empty(x.shape[0], np.uint32)
    for i in range(x.shape[0]):
        out[i] = widened(x[i], kind)
    return out


@njit(nogil=True, cache=True)
def load_pool(want, wlen, slot_page, slot_version, slot_fill, versions, members_t, counts,
              pin_ids, pin_members, pin_count, pin_version, pin_rows, main, S, pool_at, valid,
              pool_row, track, store_k, store_v, kind, pool_k, pool_v, src, dst):
    """``ResidentKV.load`` on the CPU in one call (its reference is that method's general path:
    :func:`plan_head` per head, then one gather and one scatter through torch).

    Per KV head h: :func:`plan_head` for the ``want[h, :wlen[h]]`` pages in the first ``main``
    slots (page table ``members_t[h]``, ``counts[h]``, ``versions[h]``), then for the pinned pages
    ``pin_ids`` (table ``pin_members``/``pin_count``/``pin_version``, the same for every head) in
    the slots after them; each row to load goes from the host store (``store_k``/``store_v``
    (H, capacity, d), as bits: float32 as uint32, copied; 16-bit floats as uint16, widened by
    their ``kind``, :func:`widened`) straight into ``pool_k``/``pool_v``
    (H, rows, d), float32 as uint32 bits, at row ``pool_at + slot * S + t``. ``pool_row``
    (H, P * S) gets the loaded rows' host rows when ``track``; a main-slot row whose host row is
    one of the sorted ``pin_rows`` is made invalid (a pinned passage holds it). ``src``/``dst``:
    scratch of at least the rows one head may load. Returns (rows copied, pages loaded)."""
    H = want.shape[0]
    P = slot_page.shape[1]
    d = pool_k.shape[2]
    copied = loaded = 0
    npin = pin_rows.shape[0]
    for h in range(H):
        hv = valid[h, pool_at : pool_at + P * S]
        m, got = plan_head(want[h, : wlen[h]], slot_page[h, :main], slot_version[h, :main],
                           slot_fill[h, :main], versions[h], members_t[h], counts[h], 0, 0, S,
                           hv[: main * S], src, dst, 0)
        loaded += got
        if P > main:
            m, got = plan_head(pin_ids, slot_page[h, main:], slot_version[h, main:], slot_fill[h, main:],
                               pin_version, pin_members, pin_count, 0, main * S, S, hv[main * S :],
                               src, dst, m)
            loaded += got
        row_bytes = d * store_k.itemsize
        for i in range(m):  # the rows come from anywhere in the store: ask for them all first
            prefetch_row(store_k[h], src[i], row_bytes)
            prefetch_row(store_v[h], src[i], row_bytes)
        for i in range(m):
            r, t = src[i], pool_at + dst[i]
            if track:
                pool_row[h, dst[i]] = r
            for j in range(d):
                pool_k[h, t, j] = widened(store_k[h, r, j], kind)
                pool_v[h, t, j] = widened(store_v[h, r, j], kind)
        copied += m
        if npin:  # a selected row that a pinned page holds too is attended once (resident.sorted_member)
            for i in range(main * S):
                if hv[i]:
                    at = min(np.searchsorted(pin_rows, pool_row[h, i]), npin - 1)
                    if pin_rows[at] == pool_row[h, i]:
                        hv[i] = False
    return copied, loaded


@njit(parallel=True, cache=True)
def choose_layer(chosen, filled, versions, marks, tokens, n_tokens, out, n_out):
    """A step's token picks (``index_pick``) packed for every KV head of a layer in one call:
    per head h, :func:`choose_tokens` of its first ``n_tokens[h]`` ``tokens[h]`` into its token
    pages (``chosen[h]``, ``filled[h]``, ``versions[h]``, updated in place, with the stamps
    ``marks[h]``); the ids of the pages holding tokens go to ``out[h, :n_out[h]]``, the heads in
    parallel (numba's threads). Reference: ``TokenPages.choose_reference`` per head
    (``DCISelector.choose_reference``)."""
    for h in prange(len(chosen)):
        got = choose_tokens(chosen[h], filled[h], versions[h], tokens[h, : n_tokens[h]], marks[h])
        out[h, : got.shape[0]] = got
        n_out[h] = got.shape[0]


@njit(nogil=True, cache=True)
def choose_tokens(members, count, version, tokens, mark):
    """:meth:`TokenPages.choose <icecache.cache.selectors.tokens.TokenPages.choose>` in one
    pass: make the distinct host rows ``tokens`` the chosen set of the page table
    ``members``/``count``/``version`` (updated in place): a token that stays keeps its slot, one
    that leaves frees it, new ones fill the free slots in the order given, changed pages are
    packed and get a new version. Returns the ids of the pages holding tokens.

    ``mark``: int64 stamps, longer than 1 + every token and member; ``mark[0]`` counts stamps
    (``icecache.index.walk.marks``: the walk's node marks, whose protocol this follows), so a
    row's membership is one look-up, without sorting the tokens or searching them (a sort and
    a binary search per member mispredict their branches on each step's new picks: 21 against
    6 us for 256 tokens when the same few sets recur). Reference: ``TokenPages.choose_reference``."""
    P, S = members.shape
    T = tokens.shape[0]
    want = mark[0] + 1  # a wanted token without a slot yet
    held = want + 1  # a wanted token that keeps its slot
    mark[0] = held
    for t in range(T):
        mark[tokens[t] + 1] = want
    changed = np.zeros(P, np.bool_)
    for p in range(P):
        for s in range(S):
            m = members[p, s]
            if m < 0:
                continue
            if mark[m + 1] == want:
                mark[m + 1] = held
            else:
                members[p, s] = -1
                changed[p] = True
    t = 0
    for p in range(P):
        if t == T:
            break
        for s in range(S):
            if members[p, s] >= 0:
                continue
            while t < T and mark[tokens[t] + 1] == held:  # the next wanted token (given order) not held
                t += 1
            if t == T:
                break
            members[p, s] = tokens[t]
            changed[p] = True
            t += 1
    for p in range(P):
        if not changed[p]:
            continue
        c = 0
        for s in range(S):
            if members[p, s] >= 0:
                members[p, c] = members[p, s]
                c += 1
        for s in range(c, S):
            members[p, s] = -1
        count[p] = c
        version[p] += 1
    n = 0
    for p in range(P):
        if count[p] > 0:
            n += 1
    out = np.empty(n, np.int32)
    n = 0
    for p in range(P):
        if count[p] > 0:
            out[n] = p
            n += 1
    return out


RADIX_BITS = 8  # stable_order's digit: 256 buckets, a pass per 8 bits of the largest key


@njit(nogil=True, cache=True)
def stable_order(key, order, spare):
    """``order[:] = np.argsort(key, kind="stable")`` for int64 keys of at least -1 (the pool's
    host rows, -1 for an empty slot): a least-significant-digit radix sort, one pass per 8 bits
    of the largest key plus one, each pass stable. ``spare``: int64 scratch of ``key``'s length.
    On a step's 400 slots a head it takes a fraction of numba's merge sort (which allocates and
    compares its way through every call: 11 us a head). The reference is NumPy's stable
    argsort (tests/test_ice_cache.py)."""
    n = key.shape[0]
    top = np.int64(0)
    for i in range(n):
        order[i] = i
        top = max(top, key[i] + 1)
    count = np.empty(1 << RADIX_BITS, np.int64)
    mask = np.int64((1 << RADIX_BITS) - 1)
    shift = 0
    into_spare = True  # this pass reads order and writes spare (the next one the other way)
    while shift == 0 or (top >> shift) > 0:
        src, dst = (order, spare) if into_spare else (spare, order)
        count[:] = 0
        for i in range(n):
            count[((key[src[i]] + 1) >> shift) & mask] += 1
        at = np.int64(0)
        for b in range(count.shape[0]):
            c = count[b]
            count[b] = at
            at += c
        for i in range(n):
            b = ((key[src[i]] + 1) >> shift) & mask
            dst[count[b]] = src[i]
            count[b] += 1
        into_spare = not into_spare
        shift += RADIX_BITS
    if not into_spare:  # the last pass wrote spare
        order[:] = spare


@njit(nogil=True, cache=True)
def ordered_offsets_nb(rows, valid, top, keep):
    """:func:`icecache.cache.positions.ordered_offsets` (its NumPy version is the reference,
    tested equal) in one pass per head: ``rows`` (H, n) int64 host rows of the pool slots,
    ``valid`` (H, n) bool -> (offset (H, n), span (H,)) int64."""
    H, n = rows.shape
    offset = np.empty((H, n), np.int64)
    span = np.empty(H, np.int64)
    key = np.empty(n, np.int64)
    after = np.empty(n, np.int64)
    order = np.empty(n, np.int64)
    spare = np.empty(n, np.int64)
    for h in range(H):
        if n == 0:
            span[h] = top + 1 if keep >= top >= 0 else 0
            continue
        count = 0
        for j in range(n):
            if valid[h, j]:
                key[j] = rows[h, j]
                count += 1
            else:
                key[j] = -1
        stable_order(key, order, spare)  # stable: invalid rows (-1) first, in slot order
        after[n - 1] = 0
        for j in range(n - 2, -1, -1):  # distance of each sorted row before the last one
            a, b = key[order[j]], key[order[j + 1]]
            if a < 0:
                step = 1  # from an invalid row: one position (they lie past the span)
            elif a <= top and top - a <= keep:
                step = b - a  # kept rows: their true distance
            else:
                step = min(b - a, 1)
            after[j] = after[j + 1] + step
        last = key[order[n - 1]]
        add = top - last if (last >= 0 and last <= top and top - last <= keep) else 0
        for j in range(n):
            offset[h, order[j]] = after[j] + add
        first = after[n - max(count, 1)] + add if count > 0 else -1
        span[h] = top + 1 if keep >= top >= 0 else first + 1
    return offset, span


@njit(nogil=True, cache=True)
def pinned_offsets_nb(pool_row, valid, top, keep, cut, with_sink, by_votes, chosen, row_rank, anchors, spans,
                      pin_gap, room, best):
    """:func:`icecache.cache.placement.placing` with pinned answer passages in one call (its
    NumPy functions ``placing_order``, ``ordered_offsets`` and ``behind_pinned`` are the
    reference, tested equal): ``pool_row`` (H, n) int64 host rows of the pool slots, ``valid``
    (H, n) bool, the pinned slots from column ``cut``, the passages' rows from ``with_sink`` on
    moved nearest the window (``by_votes``: best voted nearest, by the votes' sorted ``chosen``
    rows, each one's passage rank ``row_rank``, ``anchors`` passages ranked of ``spans``), the other rows
    ``pin_gap`` positions farther back (where ``room`` allows it and the best voted row ``best``
    is not one that stays with the sink) -> (offset (H, n), span (H,)) int64."""
    H, n = pool_row.shape
    keys = pool_row.copy()
    top_pin = np.int64(-(2 ** 62))
    for h in range(H):
        for j in range(cut, n):
            top_pin = max(top_pin, pool_row[h, j])
    for h in range(H):
        last = np.int64(-1)
        for j in range(cut):
            if valid[h, j]:
                last = max(last, pool_row[h, j])
        for j in range(cut, n):
            p = pool_row[h, j]
            if not (valid[h, j] and p >= with_sink):
                continue
            if by_votes:  # the passage's rank (a row in none: ``anchors``, past the last)
                at = np.searchsorted(chosen, p)
                rank = row_rank[at] if at < chosen.shape[0] and chosen[at] == p else anchors
                p = (spans - rank) * (top_pin + 1) + p
            keys[h, j] = max(last, 0) + 1 + p
    offset, span = ordered_offsets_nb(keys, valid, top, keep)
    if pin_gap <= 0:
        return offset, span
    gap = min(pin_gap, room - span.max())
    if gap <= 0 or best < with_sink:
        return offset, span
    for h in range(H):
        for j in range(n):
            if valid[h, j] and (j < cut or pool_row[h, j] < with_sink):
                offset[h, j] += gap
        span[h] += gap
    return offset, span


@njit(cache=True)
def placed_decode(q, k, v, valid, scale, cap, out, placing, sink_fill, pool_at, cos_t, sin_t, rotary, groups=None,
                  turn=None):
    """An ice layer's decode attention with remapped positions on the CPU in one call: the pool
    rows' placement (:func:`pinned_offsets_nb` of the tuple ``placing``,
    :func:`~.placement.placing_args`), then :func:`~.score_kernels.paged_decode_fused` over the
    pool's own arrays with the rows turned to their places as they are scored. Returns 0, or
    the rows of rotation tables the placement needs when ``cos_t`` / ``sin_t`` (rotations from 0
    to ``pages_at``, ``pages_at - 1``, ...) have fewer (nothing written: the caller calls again
    with longer tables). The reference is :func:`~.placement.placing`,
    :func:`~.positions.place_tables` and :func:`~.paged.paged_decode_placed_rows` (a Python
    step of about a hundred microseconds a layer, most of it cold caches' misses between two
    numba calls).

    ``groups``: ``rest_estimate``'s rows (:func:`~.score_kernels.paged_decode_fused`), which sit
    together just past the farthest placed row: the query turns from its position to that
    distance for them (``turn``: the RoPE frequencies, the query's position, ``pages_at``); the
    reference is :meth:`~.ice_step.DecodeStep.attend`'s torch path (``place_keys``, the turned
    query, :func:`~.paged.paged_decode_rest`)."""
    offset, count = pinned_offsets_nb(*placing)
    need = 0
    if pool_at > 0:
        for h in range(count.shape[0]):
            need = max(need, count[h] + sink_fill - 1)
    for h in range(offset.shape[0]):
        for j in range(offset.shape[1]):
            need = max(need, offset[h, j])
    need += 1
    if need > cos_t.shape[0]:
        return need
    place = (offset, count, sink_fill, pool_at, cos_t, sin_t, rotary)
    if groups is None:
        paged_decode_fused(q, k, v, valid, scale, cap, out, place)
    else:
        inv, at, pages_at = turn
        far = at - pages_at + count.max()
        paged_decode_fused(q, k, v, valid, scale, cap, out, place, turn_queries(q, at, far, inv, rotary), groups)
    return 0


@njit(nogil=True, cache=True)
def place_rows(k, offset, count, sink_fill, pool_at, cos_t, sin_t, rotary):
    """:func:`icecache.cache.positions.place_keys`'s rotation in one pass (its torch version is
    the reference, tested equal): a copy of ``k`` (H, L, d) float32 in which, for head ``h``,
    the sink's ``pool_at`` slots turn by row ``count[h] + sink_fill - 1`` of the tables ``cos_t``
    / ``sin_t`` (R, rotary) and the pool's ``offset.shape[1]`` rows after them by row
    ``offset[h, i]``; the rows after the pool (the window) are copied as they are. The first
    ``rotary`` channels turn as two halves (the model's RoPE)."""
    H, L, d = k.shape
    out = k.copy()
    half = rotary // 2
    n = offset.shape[1]
    for h in range(H):
        for i in range(pool_at + n):
            t = count[h] + sink_fill - 1 if i < pool_at else offset[h, i - pool_at]
            for c in range(half):
                x1 = k[h, i, c]
                x2 = k[h, i, c + half]
                out[h, i, c] = x1 * cos_t[t, c] + (-x2) * sin_t[t, c]
                out[h, i, c + half] = x2 * cos_t[t, c + half] + x1 * sin_t[t, c + half]
    return out
