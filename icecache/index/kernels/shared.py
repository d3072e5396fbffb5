"""numba kernels of the shared group walk: a GQA group's queries walk a DCI-tree together (each
child read once, scored against every query), and a layer's KV heads walked in parallel.

References: :func:`search_group_shared` with a beam over every node is
``icecache.index.reference.exact_topk`` per query; :func:`select_group_shared` equals
``group_pages`` of the group's top points (tests/test_index.py).
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.extending import overload

from ... import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from ...prefetch import prefetch_row
from .pages import group_pages, merge_ranked, node_chain_pages
from .pairs import BLOCK, MAX_GROUP, block_sums, round_queries
from .query import topk_indices

PAGES_AHEAD = 2  # a walk asks for a page's keys this many pages before it scores them


@njit(nogil=True, cache=True)
def _ask_ahead(pages, i, n_pages, keys, steps, members):
    """Hint the page ``PAGES_AHEAD`` after the ``i``-th of ``pages[:n_pages]``: its keys, its
    steps where the keys have them, its members."""
    if i + PAGES_AHEAD < n_pages:
        ahead = pages[i + PAGES_AHEAD]
        prefetch_row(keys, ahead, keys.strides[0])
        prefetch_row(members, ahead, 1)
        if steps.shape[0]:
            prefetch_row(steps, ahead, 1)


@njit(nogil=True, cache=True, fastmath=True)
def _scan_pages_float(pages, n_pages, V, PX, steps, members, count, out_ids, out_pages, out_scores, m):
    """The members of ``pages[:n_pages]`` scored against every row of ``V`` (g, d), appended from
    row ``m`` a page after another; returns the new row count. The last column of the
    transformed keys is not read: the queries' is zero. ``steps``: the int8 copy's (none here)."""
    g, D = V.shape
    for i in range(n_pages):
        _ask_ahead(pages, i, n_pages, PX, steps, members)
        pg = pages[i]
        for s in range(count[pg]):
            for r in range(g):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += PX[pg, s, d] * V[r, d]
                out_scores[m, r] = acc
            out_ids[m] = members[pg, s]
            out_pages[m] = pg
            m += 1
    return m


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _block_scores(KP, pg, b, top, Vq, qsteps, g0, nq, acc, steps, out_scores, m):
    """The scores of block ``b`` of page ``pg`` (its first ``top`` keys) against queries ``g0``
    to ``g0 + nq - 1``, into ``out_scores`` from row ``m + BLOCK * b``."""
    block_sums(KP, pg, b, Vq, g0, nq, acc)
    for j in range(top):
        s = b * BLOCK + j
        c = steps[pg, s]
        for r in range(nq):
            out_scores[m + s, g0 + r] = np.float32(acc[r, j]) * (c * qsteps[g0 + r])


@njit(nogil=True, cache=True, fastmath=True)
def _scan_pages_int8(pages, n_pages, Vq, qsteps, acc, KP, steps, members, count, out_ids, out_pages,
                     out_scores, m):
    """:func:`_scan_pages_float` over the pages' int8 pair copy (``KP`` (pages, pairs, rows, 2),
    ``steps`` (pages, S): key = step x its int8 values, :func:`quantize_pages`) and the queries
    rounded to int16 (``Vq``, ``qsteps``: :func:`~.pairs.round_queries`): each score an integer
    sum over :data:`~.pairs.BLOCK` keys at a time (:func:`~.pairs.block_sums`, up to four queries
    a call, into ``acc``) times the key's step and the query's."""
    g = Vq.shape[0]
    for i in range(n_pages):
        _ask_ahead(pages, i, n_pages, KP, steps, members)
        pg = pages[i]
        n = count[pg]
        for b in range((n + BLOCK - 1) // BLOCK):
            top = min(BLOCK, n - b * BLOCK)
            if g <= MAX_GROUP:  # the group in one call (a loop of one call here took a third longer)
                _block_scores(KP, pg, b, top, Vq, qsteps, 0, g, acc, steps, out_scores, m)
            else:
                for g0 in range(0, g, MAX_GROUP):
                    _block_scores(KP, pg, b, top, Vq, qsteps, g0, min(MAX_GROUP, g - g0), acc, steps, out_scores, m)
        for s in range(n):
            out_ids[m + s] = members[pg, s]
            out_pages[m + s] = pg
        m += n
    return m


def _scan_pages(pages, n_pages, P, keys, steps, members, count, out_ids, out_pages, out_scores, m):
    """The members of ``pages[:n_pages]`` scored against every query of the prepared group ``P``
    (:func:`_prepared`), appended to the scanned rows from row ``m`` (a page's rows contiguous);
    returns the new row count. ``keys``: the tree's float32 transformed keys (``steps`` unused)
    or their int8 pair copy with its steps (``walk_keys``)."""
    raise NotImplementedError  # numba's overload below


@overload(_scan_pages, inline="always")
def _scan_pages_of(pages, n_pages, P, keys, steps, members, count, out_ids, out_pages, out_scores, m):
    if isinstance(keys, types.Array) and keys.dtype == types.int8:
        def rounded(pages, n_pages, P, keys, steps, members, count, out_ids, out_pages, out_scores, m):
            return _scan_pages_int8(pages, n_pages, P[1], P[2], P[3], keys, steps, members, count, out_ids,
                                    out_pages, out_scores, m)
        return rounded

    def plain(pages, n_pages, P, keys, steps, members, count, out_ids, out_pages, out_scores, m):
        return _scan_pages_float(pages, n_pages, P[0], keys, steps, members, count, out_ids, out_pages,
                                 out_scores, m)
    return plain


def _prepared(V, keys):
    """A group's unit queries ``V`` (g, d) as the scan of ``keys`` takes them: (V, its int16
    rounding and steps, the block sums' scratch); the last three empty for float keys."""
    raise NotImplementedError  # numba's overload below


@overload(_prepared, inline="always")
def _prepared_of(V, keys):
    if isinstance(keys, types.Array) and keys.dtype == types.int8:
        def rounded(V, keys):
            q, qsteps = round_queries(V, keys.shape[1])
            return V, q, qsteps, np.empty((MAX_GROUP, BLOCK), np.int32)
        return rounded

    def plain(V, keys):
        return V, np.zeros((0, 1, 2), np.int16), np.zeros(0, np.float32), np.empty((0, BLOCK), np.int32)
    return plain


@njit(nogil=True, cache=True)
def quantize_pages(pages, PX, count, KP, steps):
    """The int8 copy of ``pages``' keys (``walk_keys: int8``): each member's first ``d``
    coordinates (the key; not the transform's last one, which the queries do not read) as
    ``round(k / step)`` with ``step = max |k| / 127`` (1 for a zero key), laid out by pairs of
    coordinates: coordinate ``j`` of slot ``s`` at ``KP[pg, j // 2, s, j % 2]`` (an odd ``d``'s
    last pair ends in 0; :mod:`.pairs`), the step at ``steps[pg, s]``. A score from the copy is
    within ``step / 2 * sum |q|`` of the float one (and the query's own int16 rounding)."""
    d = PX.shape[2] - 1
    for i in range(pages.shape[0]):
        pg = pages[i]
        for s in range(count[pg]):
            top = np.float32(0.0)
            for j in range(d):
                top = max(top, abs(PX[pg, s, j]))
            step = top / np.float32(127.0) if top > 0 else np.float32(1.0)
            for j in range(d):
                KP[pg, j // 2, s, j % 2] = np.int8(min(127.0, max(-127.0, np.rint(PX[pg, s, j] / step))))
            if d % 2:
                KP[pg, d // 2, s, 1] = 0
            steps[pg, s] = step


@njit(nogil=True, cache=True)
def _unit(queries):
    """A group's queries (g, d) as unit vectors (float32) and their norms (at least 1e-12)."""
    g, d = queries.shape
    V = np.zeros((g, d), np.float32)
    norms = np.empty(g, np.float32)
    for r in range(g):
        acc = 0.0
        for j in range(d):
            acc += queries[r, j] * queries[r, j]
        norms[r] = max(np.sqrt(acc), 1e-12)
        for j in range(d):
            V[r, j] = queries[r, j] / norms[r]
    return V, norms


@njit(nogil=True, cache=True)
def _walk_down(P, beam, keys, steps, top, top_level, first_page, next_page, members, count, mark, scratch_ids,
               scratch_pages, scratch_scores, extra, n_extra, owner, todo):
    """The group's shared walk down to the bottom level: the levels above it scanned into the
    scratch rows from row 0, the bottom level's pages left to scan listed in ``todo`` (then
    ``extra[:n_extra]``'s pages that the walk does not reach, see :func:`_extra_pages`).
    Returns (rows scanned, pages listed), or -1 rows when the scratch arrays cannot hold the
    listed pages' rows too (the caller grows them and walks again). ``P``: the group's unit
    queries as the scan takes them (:func:`_prepared`); ``todo``: room for a page per tree page
    and per extra page.

    At each level the union of every query's ``beam`` best nodes is expanded, and each child is
    read once and scored against all queries (a GQA group's queries share one KV head, and
    reading the index, not arithmetic, is what a query costs). Row i of ``scratch_ids`` /
    ``scratch_pages`` / ``scratch_scores`` holds a scored point, its page and its score per
    query (unit-norm queries); a page's rows are contiguous, and each page is scanned once (a
    page has one owner node, a level's nodes are expanded once: a level lists each page at most
    once, and the extra pages once each).

    ``top``: the tree's top levels as one contiguous copy (:func:`top_copy`); where it holds any
    (its first field, the lowest level it holds, above 0) they are scanned whole, and the walk
    goes on from that level's ``beam`` best nodes per query.
    """
    stamp = mark[0] + 1  # mark[0] counts calls; node 0 (the root) is never marked
    mark[0] = stamp
    rows = scratch_ids.shape[0]
    if top[0] > 0:
        lvl, first, top_keys, top_steps, top_members, top_count, top_pages = top
        kept = top_pages.shape[0]
        if kept > rows:
            return -1, 0
        _scan_pages(np.arange(top_count.shape[0]).astype(np.int32), top_count.shape[0], P, top_keys, top_steps,
                    top_members, top_count, scratch_ids, scratch_pages, scratch_scores, 0)
        scratch_pages[:kept] = top_pages
        for i in range(first):  # the points above the lowest level own the copy's pages: expanded
            mark[scratch_ids[i] + 1] = stamp
        frontier = _expand(scratch_ids, scratch_scores, first, kept, beam, mark, stamp)
        lvl -= 1
    else:
        frontier = np.zeros(1, np.int64)
        kept = 0
        lvl = top_level
    while True:
        # the level's pages first (their links are read back to back), then their keys, each
        # page's asked for a few pages ahead of its scan
        n_pages, need = node_chain_pages(frontier, first_page, next_page, count, todo, 0)
        need += kept
        if lvl <= 0:
            n_pages, need = _extra_pages(extra, n_extra, owner, top_level, mark, count, todo, n_pages, need)
            if need > rows:
                return -1, 0
            return kept, n_pages
        if need > rows:
            return -1, 0
        m = _scan_pages(todo, n_pages, P, keys, steps, members, count, scratch_ids, scratch_pages, scratch_scores,
                        kept)
        if m > kept:
            frontier = _expand(scratch_ids, scratch_scores, kept, m, beam, mark, stamp)
        kept = m
        lvl -= 1


@njit(nogil=True, cache=True)
def _expand(scratch_ids, scratch_scores, lo, hi, beam, mark, stamp):
    """The nodes a walk expands next: the union of each query's ``beam`` best of the scanned rows
    ``lo:hi`` (one level's points), each marked with ``stamp`` and listed once."""
    g = scratch_scores.shape[1]
    nxt = np.empty(g * min(beam, hi - lo), np.int64)
    nn = 0
    for r in range(g):
        best = topk_indices(scratch_scores[lo:hi, r].copy(), min(beam, hi - lo))
        for t in range(best.shape[0]):
            node = scratch_ids[lo + best[t]] + 1
            if mark[node] != stamp:
                mark[node] = stamp
                nxt[nn] = node
                nn += 1
    return nxt[:nn]


def _copy_row(to, x, t, keys, pg, s):
    """Row ``s`` of page ``pg`` of ``keys`` into row ``t`` of page ``x`` of ``to`` (the same layout:
    the float keys' (pages, rows, D) or the int8 copy's pairs (pages, pairs, rows, 2))."""
    raise NotImplementedError  # numba's overload below


@overload(_copy_row, inline="always")
def _copy_row_of(to, x, t, keys, pg, s):
    if isinstance(keys, types.Array) and keys.ndim == 4:
        def pairs(to, x, t, keys, pg, s):
            for j in range(keys.shape[1]):  # (element by element: a slice's view costs more here)
                to[x, j, t, 0] = keys[pg, j, s, 0]
                to[x, j, t, 1] = keys[pg, j, s, 1]
        return pairs

    def rows(to, x, t, keys, pg, s):
        for j in range(keys.shape[2]):
            to[x, t, j] = keys[pg, s, j]
    return rows


@njit(nogil=True, cache=True)
def top_copy(top_level, first_page, next_page, members, count, keys, steps, max_rows):
    """The levels of a tree that a shared walk scans whole (:func:`_walk_down`): those from the
    top down to the lowest level above the bottom at which they still hold at most ``max_rows``
    points, their pages' rows copied back to back into pages of their own.

    Walked level by level, those levels are a chain of small reads that depend on each other
    (a node's pages, then their keys, then the next level's nodes); the copy is one contiguous
    read. Returns ``(lowest, first, keys, steps, members, count, pages)``: the lowest level held
    (0: none, the walk goes level by level), the first row of that level's points (the levels
    above come first), the copy's keys and steps (the layout of ``keys`` and ``steps``, full
    pages of the tree's page size but the last), members and counts, and each row's tree page
    (a tree page's rows stay together, as a walk scans them)."""
    S = members.shape[1]
    pages = np.empty(members.shape[0], np.int32)
    nodes = np.zeros(1, np.int64)  # the root
    n = total = 0
    # the lowest level held (0: none), the pages and rows from the top down to it, its own rows
    lowest = held_pages = held_rows = last_rows = 0
    for lvl in range(top_level, 0, -1):  # (level 0's pages are the bottom)
        start = n
        n, here = node_chain_pages(nodes, first_page, next_page, count, pages, n)
        total += here
        if total > max_rows:
            break
        lowest, held_pages, held_rows, last_rows = lvl, n, total, here
        nodes = np.empty(here, np.int64)
        c = 0
        for j in range(start, n):
            for s in range(count[pages[j]]):
                nodes[c] = members[pages[j], s] + 1
                c += 1
    if lowest == 0:
        return (0, 0, keys[:0].copy(), steps[:0].copy(), members[:0].copy(), count[:0].copy(),
                np.empty(0, np.int32))
    X = (held_rows + S - 1) // S
    top_keys = np.zeros((X,) + keys.shape[1:], keys.dtype)
    top_steps = np.ones((X if steps.shape[0] else 0, steps.shape[1]), steps.dtype)
    top_members = np.full((X, S), -1, members.dtype)
    top_count = np.zeros(X, count.dtype)
    top_pages = np.empty(held_rows, np.int32)
    m = 0
    for j in range(held_pages):
        pg = pages[j]
        for s in range(count[pg]):
            x, t = m // S, m % S
            _copy_row(top_keys, x, t, keys, pg, s)
            if steps.shape[0]:
                top_steps[x, t] = steps[pg, s]
            top_members[x, t] = members[pg, s]
            top_count[x] += 1
            top_pages[m] = pg
            m += 1
    return lowest, held_rows - last_rows, top_keys, top_steps, top_members, top_count, top_pages


@njit(nogil=True, cache=True)
def _extra_pages(extra, n_extra, owner, top_level, mark, count, todo, n_pages, need):
    """Append to ``todo[:n_pages]`` (the bottom pages a walk scans) the pages ``extra[:n_extra]``
    that it does not scan, once each; ``need`` counts rows. A bottom page is scanned when its
    owner node was expanded (marked with the walk's stamp, ``mark[0]``), or when the root's
    children are the bottom level. Returns (pages listed, rows needed)."""
    if top_level <= 0:
        return n_pages, need
    stamp = mark[0]
    for e in range(n_extra):
        pg = extra[e]
        node = owner[pg]
        if node <= 0 or mark[node] == stamp or count[pg] == 0:
            continue  # retired, or scanned by the walk
        dup = False
        for f in range(e):
            if extra[f] == pg:
                dup = True
                break
        if dup:
            continue
        todo[n_pages] = pg
        n_pages += 1
        need += count[pg]
    return n_pages, need


@njit(nogil=True, cache=True)
def _walk_shared(queries, beam, keys, steps, top, top_level, first_page, next_page, members, count, mark,
                 scratch_ids, scratch_pages, scratch_scores, extra, n_extra, owner):
    """The group's whole walk (:func:`_walk_down`, then its bottom pages and the extra pages
    scanned); returns (rows scanned, query norms, the queries as the scan takes them:
    :func:`_prepared`), or -1 rows when the scratch arrays are too short."""
    V, norms = _unit(queries)
    P = _prepared(V, keys)
    todo = np.empty(members.shape[0] + n_extra, np.int32)
    kept, n_todo = _walk_down(P, beam, keys, steps, top, top_level, first_page, next_page, members, count, mark,
                              scratch_ids, scratch_pages, scratch_scores, extra, n_extra, owner, todo)
    if kept < 0:
        return -1, norms, P
    m = _scan_pages(todo, n_todo, P, keys, steps, members, count, scratch_ids, scratch_pages, scratch_scores, kept)
    return m, norms, P


@njit(nogil=True, cache=True)
def search_group_shared(queries, k, beam, keys, steps, top, top_level, first_page, next_page, members, count,
                        mark, scratch_ids, scratch_pages, scratch_scores, out_ids, out_scores):
    """Top-``k`` points for each of a group's queries (g, d), the group walking the tree together.

    Each query keeps its own beam and its own top-``k``, chosen among everything the group
    scanned (on clustered test data this finds more of the true top keys than lone walks with
    the same beam). ``mark``: int64 per node (n + 1), reused across calls; ``scratch_scores``:
    (rows, g). Returns False when the scratch was too short (nothing written).
    """
    g = queries.shape[0]
    kept, norms, _ = _walk_shared(queries, beam, keys, steps, top, top_level, first_page, next_page, members,
                                  count, mark, scratch_ids, scratch_pages, scratch_scores,
                                  np.empty(0, np.int32), 0, np.empty(0, np.int32))
    if kept < 0:
        return False
    for r in range(g):
        col = scratch_scores[:kept, r].copy()
        kk = min(k, kept)
        order = topk_indices(col, kk)
        for t in range(k):
            if t < kk:
                out_ids[r, t] = scratch_ids[order[t]]
                out_scores[r, t] = col[order[t]] * norms[r]
            else:
                out_ids[r, t] = -1
                out_scores[r, t] = -np.inf
    return True


@njit(nogil=True, cache=True)
def page_runs(scratch_pages, kept):
    """The walk's scanned rows as page runs (a page's scanned rows are one contiguous run, see
    ``_walk_shared``): the pages, and each run's first row (one more entry: ``kept``)."""
    pages = np.empty(kept, np.int32)
    starts = np.empty(kept + 1, np.int64)
    n = 0
    for i in range(kept):
        if i == 0 or scratch_pages[i] != scratch_pages[i - 1]:
            pages[n] = scratch_pages[i]
            starts[n] = i
            n += 1
    starts[n] = kept
    return pages[:n], starts[: n + 1]


NEGLIGIBLE = 16.0  # mass_pages: a scaled score this far below a query best adds under 1.2e-7 of it


@njit(nogil=True, cache=True)
def best_pages(pages, starts, scratch_scores, r, max_pages):
    """Query ``r``'s pages (runs of :func:`page_runs`) ranked by their best scored member, at
    most ``max_pages``.

    The same list as ``ranked_pages`` of the query's top ``max_pages x page_size`` points (a
    page's rank there is its best member's rank, and that many points cannot hold more than
    ``max_pages`` distinct pages before the last one's best member), without ranking the points.
    """
    n = pages.shape[0]
    best = np.empty(n, np.float32)
    for j in range(n):
        b = scratch_scores[starts[j], r]
        for i in range(starts[j] + 1, starts[j + 1]):
            b = max(b, scratch_scores[i, r])
        best[j] = b
    order = topk_indices(best, min(max_pages, n))
    return pages[order]


@njit(nogil=True, cache=True)
def ranks_pages(pages, starts, scratch_scores, max_pages):
    """The group's pages (runs of :func:`page_runs`): each query's pages by their best scanned
    member (:func:`best_pages`), merged rank by rank, at most ``max_pages``."""
    g = scratch_scores.shape[1]
    lists = np.empty((g, max_pages), np.int32)
    lens = np.zeros(g, np.int64)
    for r in range(g):
        best = best_pages(pages, starts, scratch_scores, r, max_pages)
        lists[r, : best.shape[0]] = best
        lens[r] = best.shape[0]
    return merge_ranked(lists, lens, max_pages)


@njit(nogil=True, cache=True, fastmath=True)
def exp_near(x, out):
    """out[i] = exp(x[i]) for x[i] in (-NEGLIGIBLE, 0], 0 at or below -NEGLIGIBLE; ``x`` and
    ``out`` must not overlap. exp(x / 16) by its degree-10 Taylor polynomial on (-1, 0], squared
    four times: relative error under 1e-5, and a loop the compiler vectorizes (numba's ``np.exp``
    is a call per element here, without SVML)."""
    for i in range(x.shape[0]):
        t = max(x[i], np.float32(-NEGLIGIBLE)) * np.float32(1.0 / 16.0)
        p = np.float32(1.0 / 3628800.0)
        p = p * t + np.float32(1.0 / 362880.0)
        p = p * t + np.float32(1.0 / 40320.0)
        p = p * t + np.float32(1.0 / 5040.0)
        p = p * t + np.float32(1.0 / 720.0)
        p = p * t + np.float32(1.0 / 120.0)
        p = p * t + np.float32(1.0 / 24.0)
        p = p * t + np.float32(1.0 / 6.0)
        p = p * t + np.float32(0.5)
        p = p * t + np.float32(1.0)
        p = p * t + np.float32(1.0)
        p = p * p
        p = p * p
        p = p * p
        p = p * p
        out[i] = p if x[i] > -NEGLIGIBLE else np.float32(0.0)


@njit(nogil=True, cache=True, fastmath=True)
def scanned_weights(scratch_scores, norms, scale, kept):
    """Each of the walk's ``kept`` scanned rows' estimated share of the group's attention: per
    query a softmax (scores x ``scale``) over the scanned rows (they hold its largest scores),
    summed over the group's queries, so each query counts alike whatever its scores' scale. A
    row more than :data:`NEGLIGIBLE` below the query's best counts 0 (its weight is under 1e-13
    of the best's). The scores are taken a query at a time into a contiguous row, so that the
    exponentials (:func:`exp_near`) run vectorized: 22.8 against 54.7 us per group of 3 queries
    over 2322 scanned rows. ``scratch_scores`` is read only. Reference: the group weights of
    the scanned rows' keys in float64 (``icecache.cache.selectors.tokens.group_weights``)."""
    g = scratch_scores.shape[1]
    x = np.empty((g, kept), np.float32)
    best = np.full(g, -np.inf, np.float32)
    for i in range(kept):
        for r in range(g):
            v = scratch_scores[i, r]
            x[r, i] = v
            best[r] = max(best[r], v)
    e = np.empty(kept, np.float32)
    weight = np.zeros(kept, np.float32)
    for r in range(g):
        row = x[r]
        c = norms[r] * scale  # the walk's scores are against the query's unit vector
        top = best[r] * c
        for i in range(kept):
            row[i] = row[i] * c - top
        exp_near(row, e)
        z = np.float32(0.0)
        for i in range(kept):
            z += e[i]
        inv = np.float32(1.0) / z
        for i in range(kept):
            weight[i] += e[i] * inv
    return weight


@njit(nogil=True, cache=True, fastmath=True)
def mass_pages(pages, starts, weight, max_pages):
    """The group's pages (runs of :func:`page_runs`) ranked by the attention mass its queries
    are estimated to put on them (the sum of their scanned members' ``weight``, the rows'
    :func:`scanned_weights`), at most ``max_pages``: the pages that hold the most of the group's
    summed attention, the figure the selection is judged by."""
    n = pages.shape[0]
    mass = np.empty(n, np.float32)
    for j in range(n):
        acc = np.float32(0.0)
        for i in range(starts[j], starts[j + 1]):
            acc += weight[i]
        mass[j] = acc
    order = topk_indices(mass, min(max_pages, n))
    return pages[order]


@njit(nogil=True, cache=True)
def kth_largest(weight, k):
    """The ``k``-th largest of the non-negative float32 ``weight`` (1 <= k <= its length),
    exactly: a non-negative float's bits, read as an integer, order as the float does, so three
    histograms of 12, 11 and 8 bits find its bits from the top down (about 10 us for 3500
    weights, where numba's ``np.partition`` takes 44). Reference: ``np.sort(weight)[-k]``."""
    bits = weight.view(np.int32)
    n = bits.shape[0]
    prefix = np.int32(0)
    mask = np.int32(0)
    need = k
    for shift, width in ((19, 12), (8, 11), (0, 8)):
        nb = 1 << width
        hist = np.zeros(nb, np.int64)
        for i in range(n):
            if bits[i] & mask == prefix:
                hist[(bits[i] >> shift) & (nb - 1)] += 1
        above = 0
        b = nb - 1
        while above + hist[b] < need:
            above += hist[b]
            b -= 1
        need -= above
        prefix |= np.int32(b << shift)
        mask |= np.int32((nb - 1) << shift)
    out = np.empty(1, np.int32)
    out[0] = prefix
    return out.view(np.float32)[0]


@njit(nogil=True, cache=True)
def top_rows(weight, ids, take):
    """The ids of the ``take`` rows of largest non-negative ``weight`` (all when they fit), in
    row order; of rows that tie at the cut, the earliest. Reference:
    ``icecache.cache.selectors.tokens.top_tokens``."""
    n = weight.shape[0]
    if n <= take:
        return ids[:n].copy()
    thr = kth_largest(weight, take)
    above = 0
    for j in range(n):
        if weight[j] > thr:
            above += 1
    ties = take - above
    out = np.empty(take, ids.dtype)
    c = 0
    for j in range(n):
        if weight[j] > thr or (weight[j] == thr and ties > 0):
            if weight[j] == thr:
                ties -= 1
            out[c] = ids[j]
            c += 1
    return out


@njit(nogil=True, cache=True, fastmath=True)
def peak_pages(pages, starts, scratch_scores, norms, scale, max_pages):
    """The group's pages (runs of :func:`page_runs`) ranked by an attention mass estimated from
    each page's best scanned member alone, at most ``max_pages``.

    Per query, a softmax (scores x ``scale``) over the pages' best scores; a page's estimate is
    the sum of its weights over the group's queries. Like :func:`mass_pages`, the queries count
    alike whatever their scores' scale (each query's weights sum to one), at one exponential per
    page and query instead of one per scanned row.
    """
    n = pages.shape[0]
    g = scratch_scores.shape[1]
    best = np.empty((n, g), np.float32)
    top = np.full(g, -np.inf, np.float32)
    for j in range(n):
        for r in range(g):
            best[j, r] = -np.inf
        for i in range(starts[j], starts[j + 1]):
            for r in range(g):
                best[j, r] = max(best[j, r], scratch_scores[i, r])
        for r in range(g):
            best[j, r] *= norms[r] * scale
            top[r] = max(top[r], best[j, r])
    z = np.zeros(g, np.float32)
    for j in range(n):
        for r in range(g):
            best[j, r] = np.exp(best[j, r] - top[r])
            z[r] += best[j, r]
    mass = np.zeros(n, np.float32)
    for j in range(n):
        acc = np.float32(0.0)
        for r in range(g):
            acc += best[j, r] / z[r]
        mass[j] = acc
    order = topk_indices(mass, min(max_pages, n))
    return pages[order]


MERGES = ("ranks", "mass", "peaks")  # the merge rules' codes in the kernels: their index here


@njit(nogil=True, cache=True)
def select_group_shared(queries, k, max_pages, beam, keys, steps, top, top_level, first_page, next_page,
                        members, count, tok_page, mark, scratch_ids, scratch_pages, scratch_scores,
                        extra, n_extra, owner, merge=0, scale=1.0, take=0):
    """``select_group`` with the shared walk of ``search_group_shared``: (pages, tokens, ok).

    When ``k`` >= ``max_pages`` x page size (the cache's case: budget pages x page size), each
    query's page list comes from its best member per page (:func:`best_pages`) instead of ranking
    its top-``k`` points: the same pages, without sorting ``k`` points per query; the lists are
    merged rank by rank (``merge`` 0, see :data:`MERGES`). ``merge`` 1: the group's pages by
    estimated attention mass instead (:func:`mass_pages`, softmax scale ``scale``); 2: by the
    mass estimated from each page's best member (:func:`peak_pages`). ``extra[:n_extra]``:
    bottom-level pages (a previous step's choice) ranked with the walk's pages whether the walk
    reached them or not (the page path only; ``owner`` is the tree's page owners).

    ``take`` > 0 (the page path only): ``tokens`` are also the ids of the ``take`` scanned rows
    (extra pages included) of largest :func:`scanned_weights` (softmax scale ``scale``), in scan
    order (:func:`top_rows`); else empty. ``ok`` is False when the scratch was too short.
    """
    g = queries.shape[0]
    none = np.empty(0, np.int32)
    if k < max_pages * members.shape[1]:  # (members: (pages, page size))
        ids = np.empty((g, k), np.int32)
        scores = np.empty((g, k), np.float32)
        if not search_group_shared(queries, k, beam, keys, steps, top, top_level, first_page, next_page,
                                   members, count, mark, scratch_ids, scratch_pages, scratch_scores, ids, scores):
            return none, none, False
        return group_pages(ids, tok_page, max_pages), none, True
    kept, norms, _ = _walk_shared(queries, beam, keys, steps, top, top_level, first_page, next_page, members,
                                  count, mark, scratch_ids, scratch_pages, scratch_scores, extra, n_extra, owner)
    if kept < 0:
        return none, none, False
    pages, tokens = _ranked(kept, norms, max_pages, merge, scale, take, scratch_ids, scratch_pages, scratch_scores)
    return pages, tokens, True


@njit(nogil=True, cache=True)
def _ranked(kept, norms, max_pages, merge, scale, take, scratch_ids, scratch_pages, scratch_scores):
    """A group walk's (``kept`` scanned rows) ranked pages by the ``merge`` rule and, with
    ``take`` > 0, its ``take`` tokens (:func:`select_group_shared`)."""
    tokens = np.empty(0, np.int32)
    weight = np.empty(0, np.float32)
    if take > 0 or merge == 1:  # the rows' weights, once for the pick and the mass merge
        weight = scanned_weights(scratch_scores, norms, scale, kept)
    if take > 0:
        tokens = top_rows(weight, scratch_ids[:kept], take)
    runs, starts = page_runs(scratch_pages, kept)
    if merge == 1:
        return mass_pages(runs, starts, weight, max_pages), tokens
    if merge == 2:
        return peak_pages(runs, starts, scratch_scores, norms, scale, max_pages), tokens
    return ranks_pages(runs, starts, scratch_scores, max_pages), tokens


SCAN_ROWS = 256  # rows a task of a layer's bottom-level scan takes (select_heads_shared)


def split_heads(heads: int) -> bool:
    """Whether a layer's walk of ``heads`` KV heads cuts its bottom scans into tasks
    (:func:`select_heads_shared`'s ``split``): fewer heads than numba's threads."""
    return heads < get_num_threads()


@njit(parallel=True, cache=True)
def select_heads_shared(queries, k, max_pages, beams, keys_t, steps_t, tops, top_levels, first_pages, next_pages,
                        members_t, counts, tok_pages, marks, sids, spgs, sscs, out, lens, ok, extras, n_extras,
                        owners, merge, scale, take, tok_out, tok_lens, split):
    """:func:`select_group_shared` for every KV head of a layer at once, on numba's threads.
    queries (H, G, d); ``beams``/``top_levels`` (H,); the tree arrays and each head's scratch
    come as tuples indexed by head, and each head's :func:`top_copy` field by field in ``tops``:
    its two numbers as (H,) arrays, its arrays as tuples by head (numba's parallel loops take no
    tuple of tuples). Writes head h's pages to ``out[h, :lens[h]]`` and, with
    ``take`` > 0, its tokens to ``tok_out[h, :tok_lens[h]]`` (``tok_out`` (H, take)); ``ok[h]``
    is False when its scratch was too short (nothing written). ``extras`` (H, E) with
    ``n_extras`` (H,) valid: each head's ``extra`` pages.

    A head is a task unless ``split`` (the caller's choice where there are fewer heads than
    threads) and the result is pages (``k`` at least ``max_pages`` pages). With ``split`` (Gemma
    3's one KV head on two cores) the work is cut where it can be shared: the heads walk
    down to their bottom level in parallel (:func:`_walk_down`), then every head's bottom pages
    and extra pages are scanned as tasks of about :data:`SCAN_ROWS` rows on every thread (most
    of a walk's rows), then each head ranks its pages; the rows land where one head's walk puts
    them, so the result is the same. Gemma 3 270M at 16k, 2-core AVX2 machine, one process,
    the two ways alternated (5 x 24 steps each): index query 2.90 -> 2.17 ms a token, TPOT
    21.43 -> 20.33. The embedded model's 3 heads on 2 threads lost with the three parallel
    loops (index query 8.43 -> 9.32 ms at 16k), so they stay a head a task."""
    H = queries.shape[0]
    top_held, top_first, tk, ts, tm, tc, tp = tops
    if not split or k < max_pages * members_t[0].shape[1]:  # a head a task
        for h in prange(H):
            top = (top_held[h], top_first[h], tk[h], ts[h], tm[h], tc[h], tp[h])
            pages, tokens, good = select_group_shared(
                queries[h], k, max_pages, beams[h], keys_t[h], steps_t[h], top, top_levels[h], first_pages[h],
                next_pages[h], members_t[h], counts[h], tok_pages[h], marks[h], sids[h], spgs[h], sscs[h],
                extras[h], n_extras[h], owners[h], merge, scale, take)
            _put(h, pages, tokens, good, out, lens, ok, tok_out, tok_lens)
        return
    g = queries.shape[1]
    norms = np.empty((H, g), np.float32)
    prepared = []
    width = 0
    for h in range(H):
        V, nv = _unit(queries[h])
        norms[h] = nv
        prepared.append(_prepared(V, keys_t[h]))
        width = max(width, members_t[h].shape[0] + n_extras[h])
    todo = np.empty((H, width), np.int32)
    kept = np.zeros(H, np.int64)
    n_todo = np.zeros(H, np.int64)
    for h in prange(H):
        top = (top_held[h], top_first[h], tk[h], ts[h], tm[h], tc[h], tp[h])
        a, b = _walk_down(prepared[h], beams[h], keys_t[h], steps_t[h], top, top_levels[h], first_pages[h],
                          next_pages[h], members_t[h], counts[h], marks[h], sids[h], spgs[h], sscs[h], extras[h],
                          n_extras[h], owners[h], todo[h])
        kept[h] = a
        n_todo[h] = b
    # the bottom scans' tasks: runs of a head's listed pages of about SCAN_ROWS rows, each with
    # the row its first page starts at
    most = 0
    for h in range(H):
        most += n_todo[h]
    first = np.empty(most, np.int64)
    head = np.empty(most, np.int64)
    row = np.empty(most, np.int64)
    n_tasks = 0
    for h in range(H):
        if kept[h] < 0:
            continue
        count = counts[h]
        m = kept[h]
        for i in range(n_todo[h]):
            if i == 0 or m - row[n_tasks - 1] >= SCAN_ROWS:
                head[n_tasks] = h
                first[n_tasks] = i
                row[n_tasks] = m
                n_tasks += 1
            m += count[todo[h, i]]
        kept[h] = m  # the rows the head holds once scanned
    for t in prange(n_tasks):
        h = head[t]
        end = first[t + 1] if t + 1 < n_tasks and head[t + 1] == h else n_todo[h]
        P = prepared[h]
        own = (P[0], P[1], P[2], np.empty_like(P[3]))  # (the block sums' scratch: a task's own)
        _scan_pages(todo[h, first[t]:end], end - first[t], own, keys_t[h], steps_t[h], members_t[h], counts[h],
                    sids[h], spgs[h], sscs[h], row[t])
    none = np.empty(0, np.int32)
    for h in prange(H):
        if kept[h] < 0:
            _put(h, none, none, False, out, lens, ok, tok_out, tok_lens)
            continue
        pages, tokens = _ranked(kept[h], norms[h], max_pages, merge, scale, take, sids[h], spgs[h], sscs[h])
        _put(h, pages, tokens, True, out, lens, ok, tok_out, tok_lens)


@njit(nogil=True, cache=True)
def _put(h, pages, tokens, good, out, lens, ok, tok_out, tok_lens):
    """Head ``h``'s pages and tokens into :func:`select_heads_shared`'s outputs."""
    ok[h] = good
    lens[h] = pages.shape[0]
    for i in range(pages.shape[0]):
        out[h, i] = pages[i]
    tok_lens[h] = tokens.shape[0]
    for i in range(tokens.shape[0]):
        tok_out[h, i] = tokens[i]
