import sys, os
sys.path.insert(0, "/tmp/s33")
import tailest  # noqa: the patch
import torch
from icecache import generation as gen
FORCE = os.environ["FORCE"]
def _decode(self, logits, max_new_tokens, stats, on_progress, repetition_penalty):
    tok = self.loaded.tokenizer
    ids = tok(FORCE, add_special_tokens=False)["input_ids"]; total = 0.0
    for i, t in enumerate(ids):
        lp = torch.log_softmax(logits.float(), -1); top = torch.topk(lp, 3)
        rank = int((lp > lp[t]).sum()) + 1; total += float(lp[t])
        alts = " ".join(f"{tok.decode([int(j)])!r}:{float(v):.2f}" for v, j in zip(top.values, top.indices))
        print(f"  {tok.decode([t])!r:>12} {float(lp[t]):7.2f} r{rank:<4} top: {alts}", file=sys.stderr)
        if i + 1 < len(ids): logits = self.forward([t])
    print(f"FORCED total {total:.2f} TAILEST={tailest.MODE}", file=sys.stderr)
    stats.tokens_out = len(ids); return ids, stats
gen.Session._decode = _decode
from icecache_cli.app import main
main(sys.argv[1:])
