"""Scratch: forced answer; at decode steps mask regions of the sparse layers' attention (ABL=none|pool|pinned|both|window)
and print region masses at the first decode step."""
import sys, os
import numpy as np, torch
from icecache.cache import ice_layer as il
from icecache import generation as gen
from icecache import prompts as _pr
QAP = os.environ.get("QAP")
if QAP:
    def qa_messages(document, question):
        return [{"role": "user", "content": f"Here is a document.\n\n{document.strip()}\n\n" + QAP.replace("{q}", question.strip())}]
    _pr.qa_messages = qa_messages

ABL = os.environ.get("ABL", "none"); FORCE = os.environ["FORCE"]
CUR = {}; REC = []
orig_attend = il.IceLayer.attend
def attend(self, query, scale):
    CUR.clear()
    if query.shape[1] == 1 and self.answer_at and self.length > self.answer_at:
        CUR.update(me=self, first=(self.length == self.answer_at + 1), layer=self.layer_idx)
    return orig_attend(self, query, scale)
il.IceLayer.attend = attend
FREEZE = int(os.environ.get("FREEZE", "0"))
orig_select = il.IceLayer.select
def select(self, q, pages=None, wide=0.0, prefill=False):
    if FREEZE and self.answer_at and self.answer_at < self.length <= self.answer_at + FREEZE and getattr(self, "selected", None) is not None:
        P = self.spec.budget_pages if pages is None else pages
        self.selected = [w[:P] for w in self.selected]
        return
    return orig_select(self, q, pages, wide, prefill)
il.IceLayer.select = select
orig_sdpa = il.paged_decode_sdpa
def sdpa(q, k, v, valid, scale):
    if CUR:
        r = CUR["me"].resident
        L = valid.shape[-1]
        region = np.zeros(L, np.int64)
        cut = r.pool_at + (r.pool_pages - r.pinned_slots) * r.page_size
        region[r.pool_at:cut] = 1; region[cut:r.window_at] = 2; region[r.window_at:] = 3
        reg = torch.from_numpy(region)
        if CUR["first"]:
            s = torch.einsum("hgd,hld->hgl", q.float(), k.float()) * scale
            s = s.masked_fill(~valid[:, None, :], float("-inf"))
            p = torch.softmax(s, -1)
            REC.append((CUR["layer"], [float(p[..., reg == j].sum(-1).mean()) for j in range(4)]))
        if ABL == "early":
            rows = torch.as_tensor(np.asarray(r.pool_row))  # (H, slots*page)
            early = torch.zeros_like(valid)
            seg = slice(r.pool_at, r.pool_at + rows.shape[1])
            early[:, seg] = (rows >= 0) & (rows < int(os.environ["EARLY"])) & torch.from_numpy(region[seg] == 1)[None, :]
            valid = valid & ~early
        drop = {"none": [], "pool": [1], "pinned": [2], "both": [1, 2], "early": []}[ABL]
        if drop:
            valid = valid & ~torch.isin(reg, torch.tensor(drop))[None, :]
    return orig_sdpa(q, k, v, valid, scale)
il.paged_decode_sdpa = sdpa
def _decode(self, logits, max_new_tokens, stats, on_progress, repetition_penalty):
    tok = self.loaded.tokenizer
    ids = tok(FORCE, add_special_tokens=False)["input_ids"]; total = 0.0
    for i, t in enumerate(ids):
        lp = torch.log_softmax(logits.float(), -1); top = torch.topk(lp, 3)
        rank = int((lp > lp[t]).sum()) + 1; total += float(lp[t])
        alts = " ".join(f"{tok.decode([int(j)])!r}:{float(v):.2f}" for v, j in zip(top.values, top.indices))
        print(f"  {tok.decode([t])!r:>12} {float(lp[t]):7.2f} r{rank:<4} top: {alts}", file=sys.stderr)
        if i + 1 < len(ids): logits = self.forward([t])
    print(f"FORCED total {total:.2f} ABL={ABL}", file=sys.stderr)
    stats.tokens_out = len(ids); return ids, stats
gen.Session._decode = _decode
from icecache_cli.app import main
try: main(sys.argv[1:])
except SystemExit as e:
    if e.code: raise
m = np.array([x[1] for x in REC])
if len(m):
    print("first step mass sink/pool/pinned/window (mean over layers): " + "/".join(f"{x:.3f}" for x in m.mean(0)), file=sys.stderr)
    print("per layer window mass: " + " ".join(f"{l}:{x[3]:.2f}" for l, x in REC), file=sys.stderr)
