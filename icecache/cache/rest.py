"""The offloaded tokens a decode step does not load, estimated page by page (``rest_estimate``).

A step attends exactly to the sink, the loaded pages and the window; the softmax is then taken
over those rows alone, so the share of attention the other offloaded tokens would have had goes
to the loaded ones, most at a small budget. With ``rest_estimate`` each DCI-tree page that is not
loaded also takes part, as one row: the mean of its members' keys and the mean of their values,
with ``log(members)`` added to its score. Its weight is then ``members * exp(q . mean key)``,
which stands for the members' summed ``exp(q . key)`` (a lower bound, by Jensen; close for a page
of similar keys, which is what the tree's pages are). The loaded rows keep their exact scores.

:class:`RestPages` keeps, per KV head, the sums of each tree page's keys and values and its
member count, read from the host store and brought up to date from the page versions the pool
already compares (a page whose members changed is summed again). A step subtracts the rows that
are resident in the pool (a loaded page's rows, pinned passages, picked tokens), by the tree page
each row belongs to, so no token is counted twice.

Only with true positions: with remapped positions every page would sit at one distance just
beyond the window, and the estimate of a 100k-token document's pages (thousands of rows there)
buried the answer's passage (docs/results.md, session 33).
"""

from __future__ import annotations

import numpy as np
import torch

from .host_store import HostStore


class RestPages:
    """Sums of keys and values (float32, on ``device``) and member counts per tree page, per KV
    head of one layer."""

    def __init__(self, heads: int, head_dim: int, device: torch.device | str):
        self.heads, self.head_dim, self.device = heads, head_dim, torch.device(device)
        self.ksum = [torch.zeros(0, head_dim, device=self.device) for _ in range(heads)]
        self.vsum = [torch.zeros(0, head_dim, device=self.device) for _ in range(heads)]
        self.count = [torch.zeros(0, device=self.device) for _ in range(heads)]
        self.seen = [np.zeros(0, np.int64) for _ in range(heads)]  # the page versions summed

    def refresh(self, head: int, members: np.ndarray, count: np.ndarray, version: np.ndarray,
                npages: int, store: HostStore) -> None:
        """Sum again head ``head``'s pages whose version changed since the last call (every page
        the first time): ``members`` (pages, S) host rows, ``count`` (pages,) rows used."""
        if len(self.seen[head]) < npages:
            grow = max(npages, 2 * len(self.seen[head]))
            old = len(self.seen[head])
            seen = np.full(grow, -1, np.int64)
            seen[:old] = self.seen[head]
            self.seen[head] = seen
            for name in ("ksum", "vsum", "count"):
                t = getattr(self, name)[head]
                bigger = torch.zeros((grow, *t.shape[1:]), device=self.device)
                bigger[:old] = t
                getattr(self, name)[head] = bigger
        seen = self.seen[head]
        changed = np.flatnonzero(version[:npages] != seen[:npages])
        if not len(changed):
            return
        n = count[changed].astype(np.int64)
        S = members.shape[1]
        used = np.arange(S)[None, :] < n[:, None]
        rows = torch.from_numpy(np.where(used, members[changed], 0).astype(np.int64))
        mask = torch.from_numpy(used)[..., None]
        keys = (store.keys[head][rows].float() * mask).sum(1)  # (changed, d)
        values = (store.values[head][rows].float() * mask).sum(1)
        at = torch.from_numpy(changed).to(self.device)
        self.ksum[head][at] = keys.to(self.device)
        self.vsum[head][at] = values.to(self.device)
        self.count[head][at] = torch.from_numpy(n).float().to(self.device)
        seen[changed] = version[changed]

    def rest(self, npages: list[int], resident: list[tuple[torch.Tensor, torch.Tensor, np.ndarray]]):
        """The estimate rows of every head, without the resident rows: ``npages[h]`` pages of
        head ``h``; ``resident[h]`` = (keys, values (m, d) on the device, tree page of each
        (m,), -1: none). Returns keys, values (heads, P, d) float32 (each page's mean; P the
        most pages of a head) and the log of each page's count (heads, P; -inf where none is
        left, and past a head's own pages)."""
        P = max(npages)
        ks, vs, bias = [], [], []
        for h in range(self.heads):
            k = torch.zeros(P, self.head_dim, device=self.device)
            v = torch.zeros(P, self.head_dim, device=self.device)
            c = torch.zeros(P, device=self.device)
            m = npages[h]
            k[:m], v[:m], c[:m] = self.ksum[h][:m], self.vsum[h][:m], self.count[h][:m]
            rk, rv, pages = resident[h]
            ok = pages >= 0
            if ok.any():
                at = torch.from_numpy(pages[ok].astype(np.int64)).to(self.device)
                sel = torch.from_numpy(np.flatnonzero(ok)).to(rk.device)
                k.index_add_(0, at, rk[sel].float(), alpha=-1)
                v.index_add_(0, at, rv[sel].float(), alpha=-1)
                c.index_add_(0, at, torch.ones(len(at), device=self.device), alpha=-1)
            left = c > 0.5
            n = c.clamp(min=1)[:, None]
            ks.append(k / n)
            vs.append(v / n)
            bias.append(torch.where(left, c.clamp(min=1).log(), torch.full_like(c, float("-inf"))))
        return torch.stack(ks), torch.stack(vs), torch.stack(bias)
