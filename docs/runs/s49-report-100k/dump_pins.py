"""Scratch: the forced ferry answer, printing the pinned passages' text (first paged layer) and vote ranks."""
import sys
import numpy as np
sys.argv = ["forced_answer.py"] + sys.argv[1:]
sys.path.insert(0, "scripts")
from icecache.cache import ice_layer
orig = ice_layer.IceLayer.answer_spans if hasattr(ice_layer, "IceLayer") else None
cls = ice_layer.IceLayer
orig = cls.answer_spans
done = set()
import builtins
def patched(self, chooser, scale):
    had = self._pinned_load is not None
    if not getattr(builtins, "_SEEN", 0): print("PATCH CALLED", file=sys.stderr); builtins._SEEN = 1
    orig(self, chooser, scale)
    if not had and self._pinned_load is not None and id(self.votes) not in done:
        done.add(id(self.votes))
        rows = self._pinned_load[2]
        tok = builtins._TOK
        sink = self.resident.sink_fill
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        for run in np.split(rows, breaks):
            ids = builtins._IDS[sink + run[0]: sink + run[-1] + 1]
            rank = self.votes.passage_rank(run[:1])[0]
            print(f"PIN rows {run[0]}-{run[-1]} rank {rank}: {tok.decode(ids)!r}", file=sys.stderr)
cls.answer_spans = patched
import builtins
from icecache import generation
orig_prompt = None
# capture tokenizer and prompt ids
S = generation.Session
orig_pf = S.prefill
def pf(self, ids, *a, **k):
    builtins._TOK = self.loaded.tokenizer
    builtins._IDS = list(ids)
    return orig_pf(self, ids, *a, **k)
S.prefill = pf
import forced_answer
forced_answer.main()
