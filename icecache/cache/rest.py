"""The offloaded tokens a decode step does not load, estimated page by page (``rest_estimate``).

A step attends exactly to the sink, the loaded pages and the window; the softmax is then taken
over those rows alone, so the share of attention the other offloaded tokens would have had goes
to the loaded ones, most at a small budget. With ``rest_estimate`` each DCI-tree page that is not
loaded also takes part, as one row: the mean of its members' keys and the mean of their values,
with ``log(members)`` added to its score. Its weight is then ``members * exp(q . mean key)``,
which stands for the members' summed ``exp(q . key)`` (a lower bound, by Jensen; close for a page
of similar keys, which is what the tree's pages are). The loaded rows keep their exact scores.

:class:`RestPages` keeps, per KV head, each tree page's mean key, mean value and member count,
read from the host store and brought up to date from the page versions the pool already compares
(a page whose members changed is summed again). A step masks the pages loaded whole; rows
resident otherwise (pinned passages) are subtracted from their tree page, so no token is counted
twice.

A model that caps its scores (Gemma 2: ``cap * tanh(score / cap)``) has an estimate row's
score capped like a real key's before ``log(members)`` is added: its weight is ``members *
exp(cap(q . mean key))`` against the members' summed ``exp(cap(q . key))``. The Jensen bound no
longer holds one way (the cap is concave above 0 and convex below), but the estimate stays as
close as the uncapped one: ``q . mean key`` is the mean of the members' scores, so it lies
within their range, and the cap is monotone with slope at most 1, so the capped scores lie
within a range no wider around the capped mean; a page's log-weight error is at most that
spread, as without the cap.

With remapped positions the estimate rows sit at one position, just past the farthest placed
row of the pool (:meth:`~.ice_step.DecodeStep.attend`), and only on a model with sliding-window
layers (:func:`~.ice_step.attention_kind` says why).
"""

from __future__ import annotations

import numpy as np
import torch

from .host_store import HostStore


class RestPages:
    """Per KV head of one layer, each tree page's mean key (``keys_t``: (heads, head_dim, pages),
    laid out for the score product), mean value (``values``: (heads, pages, head_dim)), member
    count (``count``) and its log (``logc``), float32 on ``device``: about 130 floats per page
    and KV head, computed again when a page's members change."""

    def __init__(self, heads: int, head_dim: int, device: torch.device | str):
        self.heads, self.head_dim, self.device = heads, head_dim, torch.device(device)
        self.count = torch.zeros(heads, 0, device=self.device)
        self.keys_t = torch.zeros(heads, head_dim, 0, device=self.device)
        self.values = torch.zeros(heads, 0, head_dim, device=self.device)
        self.logc = torch.zeros(heads, 0, device=self.device)
        self.seen = np.zeros((heads, 0), np.int64)  # the page versions summed (-1: never)
        self.rows = -1  # the host store's rows when last refreshed (the caller's bookkeeping)
        self.npages = 0  # the most pages of a head then
        self._pinned = None  # rest_pinned's rows and what it derived from them (at self.rows)

    def _grow(self, pages: int) -> None:
        old = self.seen.shape[1]
        cap = max(pages, 2 * old, 64)
        seen = np.full((self.heads, cap), -1, np.int64)
        seen[:, :old] = self.seen
        self.seen = seen
        for name in ("count", "values", "logc"):
            t = getattr(self, name)
            bigger = torch.zeros((self.heads, cap, *t.shape[2:]), device=self.device)
            bigger[:, :old] = t
            setattr(self, name, bigger)
        keys_t = torch.zeros(self.heads, self.head_dim, cap, device=self.device)
        keys_t[:, :, :old] = self.keys_t
        self.keys_t = keys_t
        self.logc[:, old:] = float("-inf")

    def refresh(self, head: int, members: np.ndarray, count: np.ndarray, version: np.ndarray,
                npages: int, store: HostStore) -> None:
        """Sum again head ``head``'s pages whose version changed since the last call (every page
        the first time): ``members`` (pages, S) host rows, ``count`` (pages,) rows used."""
        if self.seen.shape[1] <= npages:  # a spare page past the last (rest pads with it)
            self._grow(npages + 1)
        seen = self.seen[head]
        changed = np.flatnonzero(version[:npages] != seen[:npages])
        if not len(changed):
            return
        n = count[changed].astype(np.int64)
        S, d = members.shape[1], self.head_dim
        used = np.arange(S)[None, :] < n[:, None]
        rows = torch.from_numpy(np.where(used, members[changed], 0).astype(np.int64))
        mask = torch.from_numpy(used)[..., None]
        sums = torch.empty(len(changed), 2 * d + 1)
        sums[:, :d] = (store.keys[head][rows].float() * mask).sum(1)
        sums[:, d : 2 * d] = (store.values[head][rows].float() * mask).sum(1)
        sums[:, -1] = torch.from_numpy(n).float()
        at = torch.from_numpy(changed).to(self.device)
        sums = sums.to(self.device)
        self.count[head, at] = sums[:, -1]
        means, self.logc[head, at] = mean_rows(sums, d)
        self.keys_t[head][:, at] = means[:, :d].T
        self.values[head, at] = means[:, d:]
        seen[changed] = version[changed]

    def rest_whole(self, npages: int, loaded: np.ndarray):
        """The estimate rows when the pool holds whole tree pages only (no pinned passage): every
        page's cached mean, with the ``loaded`` pages (heads, slots; -1: an empty slot) masked. One group, for :func:`~.paged.paged_decode_rest`."""
        bias = self.logc[:, : npages + 1].clone()  # column npages takes the empty slots
        at = torch.from_numpy(np.where(loaded >= 0, loaded, npages)).to(self.device)
        bias.scatter_(1, at, float("-inf"))
        return [(self.keys_t[:, :, :npages], self.values[:, :npages], bias[:, :npages])]

    def rest_pinned(self, npages: int, loaded: np.ndarray, rows: np.ndarray, row_page, store: HostStore):
        """The estimate rows when the pool holds whole tree pages (``loaded``: heads x main slots,
        the page of a slot in use, else -1) and pinned passages (``rows``: host rows, the same
        for every head; ``row_page(h)``: head h's tree page of each host row, -1 none).

        :meth:`rest`'s groups, with the pinned part computed once per pinned set and tree state
        (the passages stay for the whole answer; the tree changes only when keys go into it):
        every page's mean with the loaded pages and the pinned rows' pages masked; and the
        pinned rows' pages less those rows, masked again where such a page is loaded whole."""
        d = self.head_dim
        cached = self._pinned
        if cached is None or cached[0] is not rows or cached[1] != self.rows:
            held = []  # per head: the pinned rows' pages, and each row's place among them
            for h in range(self.heads):
                rp = row_page(h)[rows]
                keep = rp >= 0  # a row outside every page is in no estimate
                pages, inv = np.unique(rp[keep], return_inverse=True)
                held.append((pages, rows[keep].astype(np.int64), inv))
            T = max(1, max(len(p) for p, _r, _i in held))
            at_np = np.full((self.heads, T), npages, np.int64)  # padding: the spare page column
            less = torch.zeros(self.heads, T, 2 * d + 1)
            for h, (pages, r, inv) in enumerate(held):
                at_np[h, : len(pages)] = pages
                r = torch.from_numpy(r)
                less[h].index_add_(0, torch.from_numpy(inv), torch.cat(
                    [store.keys[h][r].float(), store.values[h][r].float(), torch.ones(len(r), 1)], -1))
            at = torch.from_numpy(at_np).to(self.device)
            pad = np.arange(T)[None, :] >= np.array([len(p) for p, _r, _i in held])[:, None]
            mean_kt, mean_v, logc = self._pages_less(at, less.to(self.device), pad)
            base = self.logc[:, : npages + 1].clone()
            base.scatter_(1, at, float("-inf"))
            cached = self._pinned = (rows, self.rows, at, mean_kt.contiguous(), mean_v.contiguous(), logc, base)
        _rows, _at_rows, at, mean_kt, mean_v, logc, base = cached
        whole = torch.from_numpy(np.where(loaded >= 0, loaded, npages)).to(self.device)
        bias = base.clone()
        bias.scatter_(1, whole, float("-inf"))
        hit = torch.zeros(self.heads, npages + 1, dtype=torch.bool, device=self.device)
        hit.scatter_(1, whole, True)
        hit[:, npages] = False
        return [(self.keys_t[:, :, :npages], self.values[:, :npages], bias[:, :npages]),
                (mean_kt, mean_v, logc.masked_fill(torch.gather(hit, 1, at), float("-inf")))]

    def rest(self, npages: int, pool_pages: np.ndarray, pool_k: torch.Tensor, pool_v: torch.Tensor):
        """The estimate rows of every head without the resident rows, as groups for
        :func:`~.paged.paged_decode_rest`: ``npages`` (the most pages of a head); ``pool_pages``
        (heads, R): the tree page of each pool row (-1: none, or not resident), ``pool_k``,
        ``pool_v`` (heads, R, d) those rows on the device.

        Two groups: every page's cached mean, with the pages that hold resident rows masked
        (-inf); and those pages again, their sums less the resident rows (at most a few dozen
        per head: the step's copy is that small, not the whole table)."""
        d = self.head_dim
        bias = self.logc[:, : npages + 1].clone()  # page npages: the padding's (none has it)
        held = [np.unique(p[p >= 0]) for p in pool_pages]
        T = max(1, max(len(u) for u in held))
        touched = np.full((self.heads, T), npages, np.int64)
        slot = np.full(pool_pages.shape, self.heads * T, np.int64)  # a row not resident: a spare slot
        for h, pages in enumerate(held):
            touched[h, : len(pages)] = pages
            ok = pool_pages[h] >= 0
            slot[h, ok] = h * T + np.searchsorted(pages, pool_pages[h, ok])
        pad = np.arange(T)[None, :] >= np.array([len(u) for u in held])[:, None]
        at = torch.from_numpy(touched).to(self.device)
        bias.scatter_(1, at, float("-inf"))
        less = torch.zeros(self.heads * T + 1, 2 * d + 1, device=self.device)
        rows = torch.cat([pool_k.float(), pool_v.float(), torch.ones(*pool_k.shape[:2], 1, device=pool_k.device)], -1)
        less.index_add_(0, torch.from_numpy(slot.reshape(-1)).to(self.device), rows.reshape(-1, 2 * d + 1).to(self.device))
        return [(self.keys_t[:, :, :npages], self.values[:, :npages], bias[:, :npages]),
                self._pages_less(at, less[:-1].view(self.heads, T, -1), pad)]

    def _pages_less(self, at: torch.Tensor, less: torch.Tensor, pad: np.ndarray):
        """Pages ``at`` (heads, T) with the sums ``less`` (heads, T, 2d + 1: keys, values, count)
        taken out of their members', as one group: (mean keys (heads, d, T), mean values
        (heads, T, d), log-counts; -inf where ``pad`` or nothing is left)."""
        d, T = self.head_dim, at.shape[1]
        count = torch.gather(self.count, 1, at)[..., None]  # (heads, T, 1)
        sums = torch.cat([torch.gather(self.keys_t, 2, at[:, None, :].expand(self.heads, d, T)).transpose(1, 2),
                          torch.gather(self.values, 1, at[..., None].expand(self.heads, T, d))], -1) * count
        means, logc = mean_rows(torch.cat([sums, count], -1) - less, d)
        logc.masked_fill_(torch.from_numpy(pad).to(self.device), float("-inf"))
        return means[..., :d].transpose(1, 2), means[..., d:], logc


def kernel_groups(rest: RestPages, groups: list) -> tuple:
    """:meth:`RestPages.rest_whole`'s (or :meth:`~RestPages.rest`'s) groups as the CPU kernel
    takes them (:func:`~.score_kernels.paged_decode_fused`): for each of two groups, its keys
    transposed (H, d, >= n), values (H, >= n, d) and bias (H, >= n) as C-contiguous float32
    NumPy arrays, then n (a missing second group: no rows). The cached tables are handed whole
    (the kernel reads their first n pages), so a step copies none of them; one layout for every
    call, so numba compiles the kernel once."""
    out: list = []
    for gk, gv, gb in groups:
        n = gk.shape[2]
        if gk.data_ptr() == rest.keys_t.data_ptr() and gv.data_ptr() == rest.values.data_ptr():
            gk, gv = rest.keys_t, rest.values  # the whole tables, whose first n pages the group is
        out += [gk.contiguous().numpy(), gv.contiguous().numpy(), np.ascontiguousarray(gb.numpy()), n]
    if len(groups) < 2:
        H, d = rest.heads, rest.head_dim
        out += [np.zeros((H, d, 0), np.float32), np.zeros((H, 0, d), np.float32), np.zeros((H, 0), np.float32), 0]
    return tuple(out)


def mean_rows(sums: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums (..., 2d + 1: keys, values, count) -> the means (..., 2d) and the log-count (-inf
    where the count is zero)."""
    count = sums[..., -1]
    means = sums[..., : 2 * d] / count.clamp(min=1)[..., None]
    logc = torch.where(count > 0.5, count.clamp(min=1).log(), torch.full_like(count, float("-inf")))
    return means, logc


def step_rest(rest: RestPages, selector, resident, store: HostStore, pinned_rows: np.ndarray | None,
              general: bool = False):
    """This decode step's estimate rows (groups for :func:`~.paged.paged_decode_rest`) for a
    layer whose pool is ``resident``, offloaded rows ``store`` and tree ``selector``
    (``has_tree``), pinned answer passages at host rows ``pinned_rows`` (None: none). The tree
    changes only when keys go into it, so ``rest`` is refreshed only when the store grew.
    ``general``: with pinned passages, :meth:`RestPages.rest` from the pool's rows instead of
    :meth:`RestPages.rest_pinned` (the reference it is tested against); a pool of single tokens
    (``index_pick``) always takes that path."""
    heads = resident.keys.shape[0]
    general = general or not selector.whole_tree_pages  # index_pick: tokens of tree pages
    if rest.rows != store.rows:
        rest.npages = 0
        for h in range(heads):
            members, count, version, n, _row_page = selector.tree_pages(h)
            rest.refresh(h, members, count, version, n, store)
            rest.npages = max(rest.npages, n)
        rest.rows = store.rows
    npages, r = rest.npages, resident
    in_pool = r.valid[:, r.pool_at : r.window_at]
    if not general:
        # the main slots hold whole tree pages at their current version (load planned so); a
        # slot is in use while any of its rows is (a row a pinned passage holds too is left out
        # of it); pinned passages, if any, in their own slots
        main, S = r.pool_pages - r.pinned_slots, r.page_size
        used = in_pool[:, : main * S].reshape(heads, main, S).any(-1)
        loaded = np.where(used, r.slot_page[:, :main], -1)
        if pinned_rows is None:
            return rest.rest_whole(npages, loaded)
        return rest.rest_pinned(npages, loaded, pinned_rows, lambda h: selector.tree_pages(h)[4], store)
    pool_pages = np.full(in_pool.shape, -1, np.int64)
    for h in range(heads):
        row_page = selector.tree_pages(h)[4]
        rows = r.pool_row[h]
        ok = in_pool[h] & (rows >= 0)
        pool_pages[h, ok] = row_page[rows[ok]]
    pool = slice(r.pool_at, r.window_at)
    return rest.rest(npages, pool_pages, r.keys[:, pool], r.values[:, pool])
