import json, sys, time, torch
from icecache.config import resolve_settings
from icecache.evals import passkey
from icecache.generation import Session
from icecache.models import load_model
weights, idx, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = json.load(open("docs/runs/s37-passkey-128k-auto/config.json"))
settings = resolve_settings("cpu", weights=weights).replace(budget=budget)
loaded = load_model(None, settings)
cases = passkey.cases(loaded.tokenizer, 131072, 5, 0, cfg["depths"])
case = cases[idx]
ids = loaded.tokenizer(case.prompt)["input_ids"]
print("case", idx, "depth", case.depth, "answer", case.answer, "tokens", len(ids), flush=True)
t = time.time()
with torch.inference_mode():
    s = Session(loaded, settings, "ice"); s.new_tokens = 8
    logits, _ = s.prefill(ids)
    top = torch.topk(logits.float().log_softmax(-1), 5)
    print("first token top5", [(loaded.tokenizer.decode([int(i)]), round(float(v), 3)) for v, i in zip(top.values, top.indices)], flush=True)
    out, _ = s.decode(logits, 8)
print("output", repr(loaded.tokenizer.decode(out)), "seconds", round(time.time() - t), flush=True)
