"""Debug: which host rows the answer passages pin in a 16k passkey case, and where the needle is."""
import sys
import numpy as np
from icecache.config import load_profile
from icecache.models import load_model
from icecache.generation import Session
from icecache.evals import passkey
from icecache.cache import ice_layer

depth = float(sys.argv[1]); extra = dict(a.split("=") for a in sys.argv[2:]); SEED = int(extra.pop("seed", 5))
settings = load_profile("cpu")
for k, v in extra.items():
    settings = settings.replace(**{k: type(getattr(settings, k))(v)})
settings = settings.replace(budget=64)
loaded = load_model(None, settings)
tok = loaded.tokenizer
case = passkey.make_case(tok, 16384, depth, int(extra.pop("seed", 5)) if False else SEED)
ids = tok(case.prompt)["input_ids"]
key_ids = tok(" " + case.answer, add_special_tokens=False)["input_ids"]
text_ids = tok("The pass key is", add_special_tokens=False)["input_ids"]
where = [i for i in range(len(ids) - len(text_ids)) if ids[i:i + len(text_ids)] == text_ids]
pre = case.prompt[: case.prompt.index("The pass key is")]
print("needle near token", len(tok(pre)["input_ids"]), "prompt", len(ids))
seen = {}
orig = ice_layer.IceLayer.answer_spans
def spy(self, chooser, scale):
    before = self._pinned_load
    orig(self, chooser, scale)
    if before is None and self._pinned_load is not None and id(self) not in seen:
        rows = self._pinned_load[2]
        seen[id(self)] = rows
        sink = self.resident.sink_fill
        runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
        print(f"layer {len(seen)}: pinned token spans", [(int(r[0]) + sink, int(r[-1]) + sink) for r in runs],
              "best token", self.votes.best + sink, "with_sink", self._with_sink() + sink if self.remap else None)
ice_layer.IceLayer.answer_spans = spy
out, _ = Session(loaded, settings, "ice").generate(ids, 8)
print("answer:", repr(tok.decode(out)), "expected", case.answer)
