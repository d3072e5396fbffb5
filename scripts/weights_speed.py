"""Decode time per token of weight formats, side by side in one process (issue 18).

Each format loads its own copy of the model; for each context length every format prefills the
same prompt, then the formats take turns (``--rounds``) timing ``--steps`` decode steps each, so a
machine that drifts slows each alike. Prints the median ms per token and the ratio to the first
format.

    python scripts/weights_speed.py --ctx 1k,8k --weights float,int4 --method ice
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from icecache.config import resolve_settings
    from icecache.generation import Session
    from icecache.models import load_model
    from icecache_cli.bench import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="1k,8k")
    ap.add_argument("--weights", default="float,int4")
    ap.add_argument("--method", default="ice")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the profile's)")
    ap.add_argument("--profile", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = args.weights.split(",")
    models = {}
    for fmt in formats:
        settings = resolve_settings(args.profile, weights=fmt)
        models[fmt] = (load_model(None, settings), settings)
    tok = models[formats[0]][0].tokenizer
    text = " ".join(f"Entry {i}: the harbor office logged ship number {i * 37 % 1000} at dawn." for i in range(20000))
    all_ids = tok(text)["input_ids"]
    print(f"threads {torch.get_num_threads()}, method {args.method}, {args.steps} steps x {args.rounds} rounds", flush=True)
    for ctx in (parse_size(c) for c in args.ctx.split(",")):
        ids = all_ids[:ctx]
        sessions, tokens, times = {}, {}, {fmt: [] for fmt in formats}
        for fmt in formats:
            loaded, settings = models[fmt]
            s = Session(loaded, settings, args.method)
            s.new_tokens = args.steps * args.rounds + 2
            logits, _ = s.prefill(ids)
            tokens[fmt] = int(logits.argmax())
            for _ in range(2):  # warm-up steps
                tokens[fmt] = int(s.forward([tokens[fmt]]).argmax())
            sessions[fmt] = s
        for _ in range(args.rounds):
            for fmt in formats:
                s = sessions[fmt]
                s.activate()
                for _ in range(args.steps):
                    t = time.perf_counter()
                    tokens[fmt] = int(s.forward([tokens[fmt]]).argmax())
                    times[fmt].append(time.perf_counter() - t)
        base = statistics.median(times[formats[0]])
        for fmt in formats:
            med = statistics.median(times[fmt])
            print(f"ctx {ctx}: {fmt:6s} {med * 1000:7.1f} ms/token  ({base / med:.2f}x {formats[0]})", flush=True)
        del sessions


if __name__ == "__main__":
    with torch.inference_mode():
        main()
