"""Scratch: at the first answer step, print the pinned passages' text (and the pool's) for a few layers, head 0."""
import sys, os
import numpy as np, torch
from icecache.cache import ice_layer as il
from icecache import generation as gen
SESS = {}
orig_attend = il.IceLayer.attend
def attend(self, query, scale):
    out = orig_attend(self, query, scale)
    if query.shape[1] == 1 and self.answer_at and self.length == self.answer_at + 1 and self.layer_idx in (12, 20):
        r = self.resident; s = SESS["s"]; tok = s.loaded.tokenizer; ids = s.cached_ids
        cut = (r.pool_pages - r.pinned_slots) * r.page_size
        for h in range(1):
            rows = np.asarray(r.pool_row[h])
            for name, part in (("pinned", rows[cut:]), ("pool", rows[:cut])):
                part = np.sort(part[part >= 0]) + r.sink_fill
                runs = np.split(part, np.where(np.diff(part) != 1)[0] + 1)
                txt = " | ".join(repr(tok.decode([ids[i] for i in run if i < len(ids)])) for run in runs if len(run))
                print(f"L{self.layer_idx} h{h} {name}: {txt}", file=sys.stderr)
    return out
il.IceLayer.attend = attend
og = gen.Session._decode
def _decode(self, *a, **k):
    SESS["s"] = self
    return og(self, *a, **k)
gen.Session._decode = _decode
from icecache_cli.app import main
try: main(sys.argv[1:])
except SystemExit as e:
    if e.code: raise
