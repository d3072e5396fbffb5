"""The prompt's end of long cases, replayed under other settings from saved chunk states.

  python states.py prefill DIR TASK LENGTH CASES        # e.g. passkey 32768 0,1,2,3,4
  python states.py tail DIR [key=value ...]             # every state in DIR, greedy 8 tokens

A sparse prefill's chunks are run once per case and saved (the stepped tail held back); ``tail``
then runs the tail and the answer from each saved state with setting overrides that do not shape
the chunks' state (tail_budget, budget, ...; ``before``/``after``: the pinned passages' extent).
Per case it prints the first answer token's top two, the greedy output and its score.
"""
import glob
import os
import sys
import time

import numpy as np
import torch

from icecache.cache.state import load_layers, save_layers
from icecache.config import resolve_settings
from icecache.evals import passkey, ruler
from icecache.generation import Session
from icecache.models import load_model

DEPTHS = [0.0, 0.25, 0.5, 0.7, 0.95]


def the_cases(tok, task, length):
    if task == "passkey":
        return [(c.prompt, (c.answer,), c.depth) for c in passkey.cases(tok, length, 5, 0, DEPTHS)]
    return [(c.prompt, c.expected, c.depth) for c in ruler.cases(task, tok, length, 5, 0, DEPTHS)]


def main():
    stage, folder = sys.argv[1], sys.argv[2]
    os.makedirs(folder, exist_ok=True)
    if stage == "prefill":
        task, length, which = sys.argv[3], int(sys.argv[4]), [int(x) for x in sys.argv[5].split(",")]
        settings = resolve_settings("cpu")
        loaded = load_model(None, settings)
        cases = the_cases(loaded.tokenizer, task, length)
        for idx in which:
            path = f"{folder}/{task}-{length}-{idx}.pt"
            if os.path.exists(path):
                continue
            prompt, expected, depth = cases[idx]
            ids = loaded.tokenizer(prompt)["input_ids"]
            t = time.time()
            with torch.inference_mode():
                s = Session(loaded, settings, "ice")
                s.new_tokens = 16
                s.prefill(ids, hold_tail=True)
                skeleton, tensors = save_layers(s.cache)
                tail = s._pending[0]
            torch.save({"skeleton": skeleton, "tensors": tensors, "tail": tail, "task": task,
                        "length": length, "idx": idx}, path + ".part")
            os.replace(path + ".part", path)
            del s, skeleton, tensors
            print(path, len(ids), "tokens", round(time.time() - t), "s", flush=True)
        return
    extra = {}
    for a in sys.argv[3:]:
        k, v = a.split("=", 1)
        extra[k] = int(v) if k in ("before", "after") else type(getattr(resolve_settings("cpu"), k))(v)
    geometry = {k: extra.pop(k) for k in ("before", "after") if k in extra}
    settings = resolve_settings("cpu").replace(**extra)
    loaded = load_model(None, settings)
    tok = loaded.tokenizer
    found = []
    for path in sorted(glob.glob(f"{folder}/*.pt")):
        saved = torch.load(path, weights_only=False)
        prompt, expected, depth = the_cases(tok, saved.get("task", "passkey"), saved["length"])[saved["idx"]]
        ids = tok(prompt)["input_ids"]
        tail = saved["tail"]
        cut = len(ids) - len(tail)
        assert ids[cut:] == tail
        task = saved.get("task", "passkey")
        new = 8 if task == "passkey" else 16
        with torch.inference_mode():
            s = Session(loaded, settings, "ice")
            s.new_tokens = 16
            s.cache = s._new_cache(len(ids))
            load_layers(s.cache, saved["skeleton"], saved["tensors"])
            del saved
            s.cache.begin_prefill(0, tail=len(tail))
            s.cached_ids = list(ids[:cut])
            s._pending = (list(tail), len(ids), lambda *a: None, None)
            s.activate()
            for k, v in geometry.items():
                setattr(s.cache.ice_layers()[0].votes, k, v)
            logits = s.finish_prefill()
            top = torch.topk(logits.float().log_softmax(-1), 2)
            out, _ = s.decode(logits, new)
        text = tok.decode(out)
        sc = passkey.score(text, expected[0]) if task == "passkey" else ruler.score(text, expected)
        found.append(sc)
        print(f"{os.path.basename(path)} depth {depth:.2f} score {sc:g} top2",
              [(tok.decode([int(i)]), round(float(v), 2)) for v, i in zip(top.values, top.indices)],
              repr(text), flush=True)
        del s
    print("settings", " ".join(sys.argv[3:]) or "(shipped)", "score", f"{np.mean(found):.3f}", f"({sum(found):g}/{len(found)})")


main()
