"""numba kernel of the cache manager: plan one KV head's page loads for a decode step.

The plain reference is :func:`plan_head_reference` (NumPy, the same contract); the tests compare
the two on random pool states.
"""

from __future__ import annotations

import numpy as np
from numba import njit


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
