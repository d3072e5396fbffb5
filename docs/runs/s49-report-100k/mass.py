"""Scratch: at the step after the answer's first token ("The"), each sparse layer's attention mass
(softmax over resident rows, mean over query heads) by region: sink, budget pages, pinned passages,
window rows before the prompt's last QN tokens (document text), the last QN window rows
(the question part of the prompt + "The"). Runs an icecache qa command line in-process (forced "The ferry")."""
import json
import sys

import torch

QN = int(sys.argv[1])
sys.argv = ["forced_answer.py", "--answer", "The ferry"] + sys.argv[2:]
sys.path.insert(0, "scripts")
from icecache.cache import ice_layer  # noqa: E402

L = ice_layer.IceLayer
orig = L.attend
rows = {}


def attend(self, query, scale):
    out = orig(self, query, scale)
    if query.shape[1] == 1 and self.answer_at and self.length == self.answer_at + 1 and getattr(self, "resident", None) is not None:
        r = self.resident
        k, v, valid = r.tensors()
        if self.remap is not None:
            k = self._placed(k, self.length - 1 - r.window_fill)
        H = self.heads
        q = query[:, 0].reshape(H, -1, query.shape[-1]).float()
        s = torch.einsum("hgd,hld->hgl", q, k.float()) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        p = torch.softmax(s, -1).mean(dim=(0, 1))
        cut = (r.pool_pages - r.pinned_slots) * r.page_size
        w0, wf = r.window_at, r.window_fill
        reg = {"sink": p[: r.pool_at].sum(), "budget": p[r.pool_at : r.pool_at + cut].sum(),
               "pinned": p[r.pool_at + cut : w0].sum(), "window_doc": p[w0 : w0 + wf - QN].sum(),
               "question": p[w0 + wf - QN : w0 + wf].sum()}
        rows[self.layer_idx] = {k2: round(float(x), 3) for k2, x in reg.items()}
    return out


L.attend = attend
import forced_answer  # noqa: E402

forced_answer.main()
print("MASS", json.dumps(rows))
keys = ["sink", "budget", "pinned", "window_doc", "question"]
print("MASS mean", {k: round(sum(r[k] for r in rows.values()) / max(1, len(rows)), 3) for k in keys})
