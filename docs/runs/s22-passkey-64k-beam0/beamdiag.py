"""Scratch: one 64k passkey case prefilled once, decoded under several decode-beam rules."""
import sys, time, math
import numpy as np, torch
from icecache.config import resolve_settings
from icecache.models import load_model
from icecache.generation import Session
from icecache.evals import passkey
from icecache.index.tree import DCITree

profile, length, case_i = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
budgets = [int(b) for b in sys.argv[4].split(",")]
rules = sys.argv[5].split(",")  # e.g. f0,f0.016,b128,sqrt1
settings = resolve_settings(profile)
loaded = load_model(None, settings)
tok = loaded.tokenizer
case = passkey.cases(tok, length, 10, 0, [i / 20 for i in range(20)])[case_i]
print("depth", case.depth, "answer", case.answer, flush=True)
ids = tok(case.prompt)["input_ids"]
orig = DCITree.beam_for

def rule_fn(r):
    if r.startswith("f"):
        frac = float(r[1:])
        return lambda n: max(32, int(frac * n))
    if r.startswith("b"):
        b = int(r[1:]); return lambda n: b
    if r.startswith("sqrt"):
        c = float(r[4:]); return lambda n: max(32, int(c * math.sqrt(n)))
    raise SystemExit(r)

s = settings.replace(budget=budgets[0])
sess = Session(loaded, s, "ice")
sess.new_tokens = 8
t = time.time()
logits, _ = sess.prefill(ids)
print(f"prefill {time.time() - t:.0f} s, first token {tok.decode([int(logits[0, -1].argmax() if logits.dim() == 3 else logits[-1].argmax())])!r}", flush=True)
for b in budgets:
    for r in rules:
        f = rule_fn(r)
        DCITree.beam_for = lambda self, wide=0.0, f=f: max(f(self.n), int(np.ceil(wide * self.n)))
        twin = sess.fork(settings.replace(budget=b))
        t = time.time()
        out, _ = twin.decode(logits.clone(), 8)
        print(f"budget {b} rule {r}: {tok.decode(out)!r} score {passkey.score(tok.decode(out), case.answer)} ({time.time() - t:.0f} s)", flush=True)
        del twin
DCITree.beam_for = orig
