"""Scratch: ice decode steps also attend to an estimate of the offloaded rows not resident:
one summary row per block (mean key, mean value, log(count) bias). TAILEST=0 off, 'page' (the
selector's pages), or an int B (token-order blocks of B rows). True positions only."""
import os, sys
import numpy as np, torch
import torch.nn.functional as F
from icecache.cache import ice_layer as il
from icecache.cache import resident as rs

MODE = os.environ.get("TAILEST", "0")
orig_load = rs.ResidentKV.load
def load(self, *a, **k):
    self.track_rows = True
    return orig_load(self, *a, **k)
rs.ResidentKV.load = load

CUR = {}
CACHE = {}
orig_attend = il.IceLayer.attend
def attend(self, query, scale):
    CUR.clear()
    if query.shape[1] == 1 and self.store is not None and self.offloaded:
        CUR["me"] = self
    return orig_attend(self, query, scale)
il.IceLayer.attend = attend

def blocks_of(layer, n):
    if MODE == "page":
        owner = layer.anchor if layer.anchor is not None else layer
        out = []
        for h in range(layer.heads):
            members, count, _v = owner.selector.page_table(h)
            blk = np.full(n, -1, np.int64)
            m = members.shape[1]
            ok = np.arange(m)[None, :] < count[:, None]
            pid = np.broadcast_to(np.arange(members.shape[0])[:, None], members.shape)
            rows = members[ok]; keep = (rows >= 0) & (rows < n)
            blk[rows[keep]] = pid[ok][keep]
            out.append(blk)
        return out
    B = int(MODE)
    return [np.arange(n) // B for _ in range(layer.heads)]

orig_sdpa = il.paged_decode_sdpa
def sdpa(q, k, v, valid, scale):
    if MODE == "0" or not CUR:
        return orig_sdpa(q, k, v, valid, scale)
    me = CUR["me"]; st = me.store; n = st.rows; r = me.resident
    H, G, d = q.shape
    key = (n, st.keys.data_ptr())
    if getattr(me, '_rest', (None,))[0] != key:
        blks = blocks_of(me, n)
        nb = max(int(b.max()) + 1 for b in blks)
        K = st.keys[:, :n].float(); V = st.values[:, :n].float()
        ks = torch.zeros(H, nb, d); vs = torch.zeros(H, nb, d); cn = torch.zeros(H, nb)
        for h in range(H):
            ok = blks[h] >= 0; b = torch.from_numpy(blks[h][ok]); okt = torch.from_numpy(ok)
            ks[h].index_add_(0, b, K[h][okt]); vs[h].index_add_(0, b, V[h][okt]); cn[h].index_add_(0, b, torch.ones(len(b)))
        me._rest = (key, blks, ks, vs, cn)
        del K, V
    _k, blks, ks, vs, cn = me._rest
    nb = ks.shape[1]
    mk, mv, cnt = ks.clone(), vs.clone(), cn.clone()
    pv = r.valid[:, r.pool_at:r.window_at]
    for h in range(H):
        ids = r.pool_row[h][pv[h]]; ids = ids[(ids >= 0) & (ids < n)]
        b = blks[h][ids]; ok = b >= 0; ids, b = ids[ok], torch.from_numpy(b[ok])
        it = torch.from_numpy(ids)
        mk[h].index_add_(0, b, -st.keys[h][it].float()); mv[h].index_add_(0, b, -st.values[h][it].float()); cnt[h].index_add_(0, b, -torch.ones(len(b)))
    c = cnt.clamp(min=1)[..., None]
    mk, mv = mk / c, mv / c
    if me.remap is not None:  # pages are placed to end at length-1-window_fill; the estimate rows too
        mk = me.remap.frame.rotate(mk, 0, me.length - 1 - r.window_fill)
    bias = torch.where(cnt > 0, cnt.clamp(min=1).log(), torch.full_like(cnt, float("-inf")))
    L = k.shape[1]
    mask = torch.zeros(H, G, L + nb)
    mask[:, :, :L].masked_fill_(~valid[:, None, :], float("-inf"))
    mask[:, :, L:] = bias[:, None, :]
    k2 = torch.cat([k, mk.to(k.dtype)], 1); v2 = torch.cat([v, mv.to(v.dtype)], 1)
    out = F.scaled_dot_product_attention(q[:, None], k2[:, None], v2[:, None], attn_mask=mask[:, None].to(q.dtype), scale=scale)
    return out[:, 0]
il.paged_decode_sdpa = sdpa

if __name__ == "__main__":
    from icecache_cli.app import main
    main(sys.argv[1:])
