"""Scratch: MODE=dump saves each layer's K/V at its first one-token step (the question's first token);
MODE=swap replaces the document-tail rows of this run's K/V with the dumped ones (aligned on the
common token suffix; keys re-rotated where they carry positions), then forced-answer as ablate.py."""
import sys, os
import numpy as np, torch
from icecache.cache import ice_layer as il
from icecache.cache import positions as pos
from icecache import generation as gen
MODE = os.environ["MODE"]; D = "/tmp/s32/swap"; FORCE = os.environ.get("FORCE", "")
WHAT = os.environ.get("WHAT", "store,window,dense").split(",")
S = {}; DONE = set()

def ids_now():
    return S["sess"].cached_ids

def handle(name, parts, n_tokens, rotate_keys):
    """parts: dict name -> (tensor view (H, m, d), first token index of row 0, is_key)."""
    f = f"{D}/{name}.pt"
    if MODE == "dump":
        torch.save({k: (t.clone(), first) for k, (t, first, _) in parts.items()} | {"_n": n_tokens, "_ids": list(S["ids"])}, f)
        return
    src = torch.load(f)
    idsC, idsD = src["_ids"], S["ids"]
    k = 0
    while k < min(len(idsC), len(idsD)) and idsC[-1 - k] == idsD[-1 - k]: k += 1
    delta = len(idsD) - len(idsC)
    lo = len(idsD) - k  # first token (this run's index) inside the common suffix
    for key, (t, first, is_key) in parts.items():
        if key.split("_")[0] not in WHAT: continue
        ct, cfirst = src[key]
        m = t.shape[1]
        # this run's rows first..first+m-1 ; take those with token >= lo and whose source row exists
        tok = np.arange(first, first + m)
        srow = tok - delta - cfirst
        ok = (tok >= lo) & (srow >= 0) & (srow < ct.shape[1])
        rows = np.nonzero(ok)[0]
        if not len(rows): continue
        val = ct[:, srow[rows]].to(t.dtype)
        if is_key and rotate_keys:
            val = S["frame"].rotate(val, 0, delta).to(t.dtype)
        t[:, rows] = val
        S.setdefault("log", []).append(f"{name}:{key} {len(rows)} rows")

orig_attend = il.IceLayer.attend
def attend(self, query, scale):
    if query.shape[1] == 1 and self.layer_idx not in DONE and self.store is not None:
        DONE.add(self.layer_idx); r = self.resident; st = self.store
        S["frame"] = self.remap.frame
        wf = r.window_fill - 1  # the current token excluded
        n = self.length
        parts = {"store_k": (st.keys[:, : st.rows], r.sink_fill, False), "store_v": (st.values[:, : st.rows], r.sink_fill, False),
                 "window_k": (r.keys[:, r.window_at : r.window_at + wf], n - 1 - wf, True),
                 "window_v": (r.values[:, r.window_at : r.window_at + wf], n - 1 - wf, False)}
        handle(f"L{self.layer_idx}", parts, n, rotate_keys=True)
    return orig_attend(self, query, scale)
il.IceLayer.attend = attend
orig_dattend = pos.RemapDenseLayer.attend
def dattend(self, query, scale):
    if id(self) not in DONE:
        DONE.add(id(self)); idx = S.setdefault("dense_i", 0); S["dense_i"] += 1
        n = self._n
        parts = {"dense_k": (self._k[0, :, : n - 1], 0, True), "dense_v": (self._v[0, :, : n - 1], 0, False)}
        S["frame"] = self.remap.frame
        handle(f"D{idx}", parts, n, rotate_keys=True)
    return orig_dattend(self, query, scale)
pos.RemapDenseLayer.attend = dattend
og_prefill = gen.Session.prefill
def prefill(self, ids, *a, **k):
    S["sess"] = self; S["ids"] = list(ids)
    return og_prefill(self, ids, *a, **k)
gen.Session.prefill = prefill
def _decode(self, logits, max_new_tokens, stats, on_progress, repetition_penalty):
    if MODE == "dump" or not FORCE:
        stats.tokens_out = 0; return [], stats
    tok = self.loaded.tokenizer
    ids = tok(FORCE, add_special_tokens=False)["input_ids"]; total = 0.0
    for i, t in enumerate(ids):
        lp = torch.log_softmax(logits.float(), -1); top = torch.topk(lp, 3)
        rank = int((lp > lp[t]).sum()) + 1; total += float(lp[t])
        alts = " ".join(f"{tok.decode([int(j)])!r}:{float(v):.2f}" for v, j in zip(top.values, top.indices))
        print(f"  {tok.decode([t])!r:>12} {float(lp[t]):7.2f} r{rank:<4} top: {alts}", file=sys.stderr)
        if i + 1 < len(ids): logits = self.forward([t])
    print(f"FORCED total {total:.2f} WHAT={WHAT}", file=sys.stderr)
    stats.tokens_out = len(ids); return ids, stats
gen.Session._decode = _decode
from icecache_cli.app import main
try: main(sys.argv[1:])
except SystemExit as e:
    if e.code: raise
print("\n".join(S.get("log", [])[:6]), file=sys.stderr)
print("swapped entries", len(S.get("log", [])), file=sys.stderr)
