"""Scratch: reference run (everything resident, true positions): at answer steps, mask the
document body in the sparse layers except KEEP rows. MODE: none | fact (keep +-24 rows around the
fact) | fact+rand:N (plus N random body rows) | fact+last:N (plus the N body rows nearest the window)
| rand:N | last:N. Prints forced 'The ferry' figures."""
import os, sys
import numpy as np, torch
sys.argv = ["forced_answer.py", "--answer", os.environ.get("ANS", "The ferry")] + sys.argv[1:]
sys.path.insert(0, "scripts")
from icecache.cache import ice_layer as il
MODE = os.environ.get("MODE", "none")
LAYERS = os.environ.get("LAYERS", "")  # e.g. 12-29
lo_l, hi_l = (map(int, LAYERS.split("-")) if LAYERS else (0, 99))
FACT = int(os.environ["FACT"])  # token position of the fact's first token
CUR = {}
orig_attend = il.IceLayer.attend
def attend(self, query, scale):
    CUR.clear()
    if query.shape[1] == 1 and self.answer_at and self.length > self.answer_at and lo_l <= self.layer_idx <= hi_l:
        CUR["me"] = self
    return orig_attend(self, query, scale)
il.IceLayer.attend = attend
rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
def masked(valid):
    me = CUR.get("me")
    if me is None or MODE == "none":
        return valid
    r = me.resident
    v = valid.clone() if torch.is_tensor(valid) else valid.copy()
    pos = r.pool_row + r.sink_fill  # token positions of pool slots
    a, b = r.pool_at, r.window_at
    body = np.asarray(valid[:, a:b]) if not torch.is_tensor(valid) else valid[:, a:b].cpu().numpy()
    keep = np.zeros_like(body)
    P = pos[:, : b - a]
    for part in MODE.split("+"):
        if part == "fact":
            keep |= (P >= FACT - 24) & (P < FACT + 24)
        elif part.startswith("rand:"):
            n = int(part[5:])
            for h in range(body.shape[0]):
                idx = np.flatnonzero(body[h])
                keep[h, rng.choice(idx, min(n, len(idx)), replace=False)] = True
        elif part.startswith("last:"):
            n = int(part[5:])
            top = P[body].max()
            keep |= P > top - n
        elif part.startswith("far:"):  # the n body rows farthest from the window, excluding the fact
            n = int(part[4:])
            keep |= P < P[body].min() + n
    new = body & keep
    if torch.is_tensor(v):
        v[:, a:b] = torch.from_numpy(new).to(v.device)
    else:
        v[:, a:b] = new
    return v
for name in ("paged_decode_sdpa",):
    f = getattr(il, name)
    def wrap(q, k, v, valid, scale, _f=f):
        return _f(q, k, v, masked(valid), scale)
    setattr(il, name, wrap)
fr = il.paged_decode_rest
def wrap_rest(q, k, v, valid, rest, scale):
    return fr(q, k, v, masked(valid), None if CUR.get("me") else rest, scale) if False else fr(q, k, v, masked(valid), rest, scale)
il.paged_decode_rest = wrap_rest
import forced_answer
forced_answer.main()
