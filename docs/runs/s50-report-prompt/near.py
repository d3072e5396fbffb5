"""Scratch: remapped decode steps also attend to the document's last NEAR rows before the window
(from the host store, at their true distance); everything before the window (sink, pages,
passages) is pushed NEAR positions farther back. STEPS=answer (answer steps) | all (tail too)."""
import os, sys
import torch
sys.argv = ["forced_answer.py", "--answer", os.environ.get("ANS", "The ferry")] + sys.argv[1:]
sys.path.insert(0, "scripts")
from icecache.cache import ice_layer as il
NEAR = int(os.environ.get("NEAR", "2048"))
STEPS = os.environ.get("STEPS", "answer")
CUR = {}
orig_attend = il.IceLayer.attend
def attend(self, query, scale):
    CUR.clear()
    if query.shape[1] == 1 and self.remap is not None :
        on = (self.answer_at and self.length > self.answer_at) if STEPS == "answer" else (self.length > self.prompt_tokens and (STEPS == "all" or self.length <= self.answer_at))
        if on:
            CUR["me"] = self
    return orig_attend(self, query, scale)
il.IceLayer.attend = attend
f = il.paged_decode_sdpa
def sdpa(q, k, v, valid, scale):
    me = CUR.get("me")
    if me is None:
        return f(q, k, v, valid, scale)
    if os.environ.get("NOPAGES"):
        r0 = me.resident
        cut = (r0.pool_pages - r0.pinned_slots) * r0.page_size
        valid = valid.clone(); valid[:, r0.pool_at : r0.pool_at + cut] = False
        if os.environ.get("ONLYBEST") and me.pinned is not None:
            import numpy as np
            pin = r0.pool_row[:, cut:]
            rk = me.votes.passage_rank(np.maximum(pin, 0))
            bad = torch.from_numpy(rk != 0)
            valid[:, r0.pool_at + cut : r0.window_at] &= ~bad
    r, st = me.resident, me.store
    first = me.length - r.window_fill  # the window's first token
    assert st.rows + r.sink_fill == first, (st.rows, r.sink_fill, first)
    n = min(NEAR, st.rows)
    if n == 0:
        return f(q, k, v, valid, scale)
    fr = me.remap.frame
    w = r.window_at
    pre = fr.rotate(k[:, :w], n, 0)  # everything before the window n positions farther back
    ek = st.keys[:, st.rows - n : st.rows].to(k.dtype)
    ev = st.values[:, st.rows - n : st.rows].to(v.dtype)
    pos = torch.arange(first - n, first)
    ek = fr.rotate(ek, torch.zeros_like(pos), pos)  # stored at position 0
    if os.environ.get("GAPONLY"):
        return f(q, torch.cat([pre, k[:, w:]], 1), v, valid, scale)
    k2 = torch.cat([pre, ek, k[:, w:]], 1)
    v2 = torch.cat([v[:, :w], ev, v[:, w:]], 1)
    ok = torch.ones(valid.shape[0], n, dtype=valid.dtype, device=valid.device)
    valid2 = torch.cat([valid[:, :w], ok, valid[:, w:]], 1)
    return f(q, k2, v2, valid2, scale)
il.paged_decode_sdpa = sdpa
import forced_answer
forced_answer.main()
