"""How likely the model finds a given answer to a question about a document: `icecache qa` with
the answer's tokens forced (teacher forcing) instead of chosen, printing each forced token's
log-probability, its rank and the model's top alternatives there.

    python scripts/forced_answer.py --answer "The ferry ... is called the Silver Heron." \
        -- qa report.txt -q "What is the ferry to Varno Island called?" --profile P --budget 64

Everything after ``--`` is an ordinary `icecache` command line (one question), so the prompt,
the prefill (sparse or full, the document cache) and the cache's settings are the CLI's own.
Greedy answers say only whether the first token that goes wrong went wrong; this says how far
each part of the answer (its opening, the fact's tokens) is from being chosen (session 31).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--answer", required=True, help="the answer whose tokens are forced")
    ap.add_argument("--top", type=int, default=3, help="alternatives shown per token")
    ap.add_argument("cli", nargs=argparse.REMAINDER, help="-- then an icecache qa command line")
    a = ap.parse_args()
    cli = a.cli[1:] if a.cli[:1] == ["--"] else a.cli
    if not cli or cli[0] != "qa":
        sys.exit("give an icecache qa command line after --")
    if sum(x in ("-q", "--question") or x.startswith("--question=") for x in cli) != 1:
        sys.exit("give the qa command line exactly one question (-q): the answer is forced for one")

    from icecache import generation

    rows: list[dict] = []

    def forced(self, logits, max_new_tokens, stats, on_progress, repetition_penalty):
        tok = self.loaded.tokenizer
        ids = tok(a.answer, add_special_tokens=False)["input_ids"]
        for i, t in enumerate(ids):
            lp = torch.log_softmax(logits.float(), -1)
            top = torch.topk(lp, a.top)
            rows.append({"token": tok.decode([t]), "logprob": round(float(lp[t]), 3),
                         "rank": int((lp > lp[t]).sum()) + 1,
                         "top": [[tok.decode([int(j)]), round(float(v), 3)] for v, j in zip(top.values, top.indices, strict=True)]})
            if i + 1 < len(ids):
                logits = self.forward([t])
        stats.tokens_out = len(ids)
        return ids, stats

    generation.Session._decode = forced
    from icecache_cli.app import main as app

    try:
        app(cli)
    except SystemExit as e:
        if e.code:
            raise
    for r in rows:
        alts = "  ".join(f"{t!r} {v:.2f}" for t, v in r["top"])
        print(f"{r['token']!r:>14} {r['logprob']:7.2f}  rank {r['rank']:<5} top: {alts}", file=sys.stderr)
    print(json.dumps({"answer": a.answer, "total_logprob": round(sum(r["logprob"] for r in rows), 3), "tokens": rows}))


if __name__ == "__main__":
    main()
