"""One passkey case prefilled once (ice, the profile's sparse prefill), then decoded from copies
of that prefill under several index-beam rules: which beam a decode step needs to keep the
needle, without paying a long prefill per rule.

    python scripts/decode_beams.py --profile cpu --length 64k --case 1 --budgets 64,256 \
        --rules f0,f0.016,b64,b128

A rule sets the nodes a decode-step query expands per level: ``bN`` a fixed N, ``fX`` at least
32 and X times the indexed keys (the old CPU rule was f0.016), ``sqrtC`` at least 32 and C times
the square root of the keys; a ``+cN`` suffix (``b32+c16``) decodes with ``carry_pages: N``
(each step ranks the last search's best N pages, the prompt's last step's choice first, beside
its walk's). The prompt's last steps (run inside the prefill) keep the profile's
rule, which includes ``tail_beam_frac``. The cases are ``icecache eval``'s (--n cases over its
default depths, keys from --seed); the case number counts from 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time

import numpy as np

from icecache.cache.selectors.dci import DCISelector
from icecache.config import resolve_settings
from icecache.evals import passkey
from icecache.generation import Session
from icecache.index.tree import DCITree
from icecache.models import load_model
from icecache_cli.bench import parse_size


def beam_rule(rule: str):
    """Nodes per level as a function of the indexed keys ``n``."""
    rule = rule.split("+c")[0]
    kind = rule.rstrip("0123456789.")
    try:
        value = float(rule[len(kind):])
    except ValueError:
        raise SystemExit(f"--rules: {rule!r} is not bN, fX or sqrtC") from None
    if kind == "b":
        return lambda n: int(value)
    if kind == "f":
        return lambda n: max(32, int(value * n))
    if kind == "sqrt":
        return lambda n: max(32, int(value * math.sqrt(n)))
    raise SystemExit(f"--rules: {rule!r} is not bN, fX or sqrtC")


def remember(self, pages):
    """``DCISelector.carry`` with ``carry_pages`` on (for the prefill)."""
    self.carried = pages
    return pages


def carry_rule(rule: str) -> int:
    """The ``carry_pages`` of a rule (0 without a ``+cN`` suffix)."""
    _, _, n = rule.partition("+c")
    try:
        return int(n or 0)
    except ValueError:
        raise SystemExit(f"--rules: {rule!r}: +c takes a number of pages") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--length", default="64k")
    ap.add_argument("--case", type=int, default=0)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--rules", default="f0,b128")
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args()
    rules = [(r, beam_rule(r), carry_rule(r)) for r in args.rules.split(",")]
    settings = resolve_settings(args.profile)
    loaded = load_model(None, settings)
    tok = loaded.tokenizer
    # the depths of `icecache eval --depths`' default (0:95:5)
    depths = passkey.parse_depths("0:95:5")
    case = passkey.cases(tok, parse_size(args.length), args.n, args.seed, depths)[args.case]
    print(f"depth {case.depth}, answer {case.answer}", flush=True)
    ids = tok(case.prompt)["input_ids"]
    shipped_carry = DCISelector.carry
    DCISelector.carry = remember  # the prefill's last choice is kept for the +cN rules
    first = Session(loaded, settings.replace(budget=int(args.budgets.split(",")[0])), "ice")
    first.new_tokens = args.new_tokens
    start = time.perf_counter()
    logits, _ = first.prefill(ids)
    top = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
    DCISelector.carry = shipped_carry
    print(f"prefill of {len(ids)} tokens: {time.perf_counter() - start:.0f} s, "
          f"first answer token {tok.decode([top])!r}", flush=True)
    shipped = DCITree.beam_for
    try:
        for budget in (int(b) for b in args.budgets.split(",")):
            for name, nodes, carry in rules:
                def beam_for(self, wide=0.0, nodes=nodes):
                    return max(nodes(self.n), int(np.ceil(wide * self.n)))
                DCITree.beam_for = beam_for
                twin = first.fork(settings.replace(budget=budget))
                for layer in twin.cache.ice_layers():
                    if isinstance(layer.selector, DCISelector):
                        layer.selector.spec = dataclasses.replace(layer.selector.spec, carry_pages=carry)
                        if not carry:
                            layer.selector.carried = None
                start = time.perf_counter()
                out, _ = twin.decode(logits.clone(), args.new_tokens)
                text = tok.decode(out)
                print(f"budget {budget}, rule {name}: {text!r}, score {passkey.score(text, case.answer):g} "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)
                del twin
    finally:
        DCITree.beam_for = shipped


if __name__ == "__main__":
    main()
