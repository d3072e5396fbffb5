"""Case 1 of the 128k passkey eval, taken apart: where the answer-span votes and the prompt-end
steps' pages land relative to the needle.

  python probe.py prefill CASE LENGTH STATE      # the chunks of a sparse prefill, saved (the tail held)
  python probe.py tail STATE [key=value ...]     # the tail steps from the saved state, then 8 tokens

Setting overrides (key=value) change the tail's settings where they do not shape the chunks'
state (answer_spans, tail_budget, ...). ``force=1`` adds a vote of 1.0 on the needle's rows
before the last step (is reading the needle enough?).
"""
import json
import sys
import time

import numpy as np
import torch

from icecache.cache.state import load_layers, save_layers
from icecache.config import resolve_settings
from icecache.evals import passkey
from icecache.generation import Session
from icecache.models import load_model

RUN = "docs/runs/s37-passkey-128k-auto/config.json"


def case_of(loaded, idx, length):
    depths = json.load(open(RUN))["depths"]
    c = passkey.cases(loaded.tokenizer, length, 5, 0, depths)[idx]
    enc = loaded.tokenizer(c.prompt, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    at = c.prompt.index("The pass key is " + c.answer)
    end = at + len("The pass key is " + c.answer + ". Remember it. " + c.answer + " is the pass key.")
    needle = [i for i, (a, b) in enumerate(offs) if a < end and b > at]
    return c, ids, needle


def overrides(args):
    out = {}
    for a in args:
        k, v = a.split("=", 1)
        out[k] = type(getattr(resolve_settings("cpu"), k, 0))(v) if k not in ("force", "before", "after") else int(v)
    return out


def main():
    stage = sys.argv[1]
    if stage == "prefill":
        idx, length, path = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        settings = resolve_settings("cpu")
        loaded = load_model(None, settings)
        c, ids, needle = case_of(loaded, idx, length)
        print("case", idx, "depth", c.depth, "answer", c.answer, "tokens", len(ids), "needle", needle[0], "..", needle[-1], flush=True)
        t = time.time()
        with torch.inference_mode():
            s = Session(loaded, settings, "ice")
            s.new_tokens = 8
            s.prefill(ids, hold_tail=True)
            tokens = s._pending[0]
            skeleton, tensors = save_layers(s.cache)
        torch.save({"skeleton": skeleton, "tensors": tensors, "tail": tokens, "idx": idx, "length": length}, path)
        print("prefill", round(time.time() - t), "s; tail", len(tokens), "tokens; saved", path, flush=True)
        return
    path, extra = sys.argv[2], overrides(sys.argv[3:])
    force = extra.pop("force", 0)
    geometry = {k: extra.pop(k) for k in ("before", "after") if k in extra}
    saved = torch.load(path, weights_only=False)
    settings = resolve_settings("cpu").replace(**extra)
    loaded = load_model(None, settings)
    c, ids, needle = case_of(loaded, saved["idx"], saved["length"])
    tail = saved["tail"]
    cut = len(ids) - len(tail)
    assert ids[cut:] == tail
    with torch.inference_mode():
        s = Session(loaded, settings, "ice")
        s.new_tokens = 8
        s.cache = s._new_cache(len(ids))
        load_layers(s.cache, saved["skeleton"], saved["tensors"])
        s.cache.begin_prefill(0, tail=len(tail))
        s.cached_ids = list(ids[:cut])
        s._pending = (list(tail), len(ids), lambda *a: None, None)
        s.activate()
        layers = s.cache.ice_layers()
        sink = layers[0].spec.sink_tokens
        rows = np.array(needle) - sink
        for k, v in geometry.items():  # the pinned passages' extent (rows before / from the anchor)
            setattr(layers[0].votes, k, v)
        if force:
            first = layers[0]
            orig = first.answer_spans.__func__

            def forced(self, chooser, scale, _orig=orig):
                _orig(self, chooser, scale)
                if self.votes is not None and self.votes.chosen is None and self.length >= self.answer_at - 1:
                    self.votes.add(np.where(np.isin(np.arange(self.store.rows), rows), 1.0, 0.0), self.length)
            for layer in layers:
                layer.answer_spans = forced.__get__(layer)
        logits = s.finish_prefill()
        top = torch.topk(logits.float().log_softmax(-1), 5)
        print("first token top5", [(loaded.tokenizer.decode([int(i)]), round(float(v), 3))
                                   for v, i in zip(top.values, top.indices)], flush=True)
        votes = layers[0].votes
        if votes is not None and len(votes.votes):
            order = np.argsort(-votes.votes, kind="stable")
            rank = {int(r): i for i, r in enumerate(order)}
            print("needle rows", rows[0], "..", rows[-1], "best vote rank", min(rank.get(int(r), 10**9) for r in rows),
                  "best needle vote", round(float(votes.votes[rows].max()), 4), "top vote", round(float(votes.votes[order[0]]), 4))
            for r in order[:8]:
                p = int(r) + sink
                print(f"  vote {votes.votes[r]:.4f} at token {p} ({p / len(ids):.3f}):",
                      repr(loaded.tokenizer.decode(ids[max(0, p - 6): p + 6])))
            pinned = votes.chosen
            print("pinned rows hold the needle:", bool(np.isin(rows, pinned).any()), "pinned", len(pinned))
        hit = []
        for layer in layers:
            pr = layer.resident.pool_row
            hit.append(float(np.mean([np.isin(rows, pr[h]).any() for h in range(pr.shape[0])])))
        print("per sparse layer, share of KV heads whose pool holds a needle row at the last step:",
              " ".join(f"{x:.2f}" for x in hit))
        out, _ = s.decode(logits, 8)
    print("output", repr(loaded.tokenizer.decode(out)), flush=True)


main()
