"""The long report's three facts over several generated documents (seeds), under one or more
variants of the qa command line: how often `icecache qa` finds a planted fact, not whether it
finds the three of one document (``long_report.py``).

    python scripts/report_suite.py --tokens 32000 --seeds 1-6 \
        --variant 'b256=--budget 256' --variant 'b64=--budget 64' [--keep DIR] [--out FILE]

Each seed's document is generated once (``long_report.document``) and prefilled once into a
document cache of its own; every variant then asks the three questions from it (a variant that
changes what the prefill computes, e.g. ``window_pages`` through ``--profile``, prefills again).
Prints one JSON line per (seed, variant) as it goes (also appended to ``--out``), then a table:
per variant, the facts found of all asked, and per fact (start, middle, end of the document).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_report import FACTS, cli, document, found  # noqa: E402


def seed_list(spec: str) -> list[int]:
    """'1-6' or '1,3,5' (or both, comma-separated) -> the seeds."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return out


def variant(spec: str) -> tuple[str, list[str]]:
    """'NAME=FLAGS' -> (NAME, the flags split as a shell would)."""
    name, sep, flags = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is NAME=FLAGS, got {spec!r}")
    return name, shlex.split(flags)


def ask(doc: Path, cache: Path, flags: list[str]) -> list[str]:
    questions = [x for _s, _f, q, _a in FACTS for x in ("-q", q)]
    out, _stats, _took = cli(["qa", str(doc), *questions, "--max-new-tokens", "24", "--doc-cache", str(cache), *flags])
    return out["output"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32_000)
    ap.add_argument("--seeds", type=seed_list, default=seed_list("1-6"))
    ap.add_argument("--variant", type=variant, action="append", default=[],
                    help="NAME=FLAGS, the qa flags of one variant (repeat; default: one 'shipped' with none)")
    ap.add_argument("--keep", type=Path, default=None, help="folder for the documents and caches (kept)")
    ap.add_argument("--out", type=Path, default=None, help="append each row as a JSON line here")
    a = ap.parse_args()
    variants = a.variant or [("shipped", [])]
    if len({n for n, _ in variants}) != len(variants):
        sys.exit("variant names must differ")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        for seed in a.seeds:
            where = root / f"r{a.tokens}-s{seed}"
            where.mkdir(parents=True, exist_ok=True)
            doc = where / "report.txt"
            doc.write_text(document(a.tokens, seed))
            for name, flags in variants:
                t0 = time.perf_counter()
                answers = ask(doc, where / "cache", flags)
                hits = [found(ans, f[3]) for ans, f in zip(answers, FACTS, strict=True)]
                row = {"tokens": a.tokens, "seed": seed, "variant": name, "flags": flags, "found": hits,
                       "seconds": round(time.perf_counter() - t0, 1), "answers": [x.strip() for x in answers]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.out:
                    with a.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
            if a.keep is None:
                shutil.rmtree(where, ignore_errors=True)
    print(f"\n{a.tokens} tokens, seeds {','.join(map(str, a.seeds))}: facts found")
    print("variant | all | " + " | ".join(f"{s:.0%} deep" for s, *_ in FACTS))
    for name, _ in variants:
        mine = [r["found"] for r in rows if r["variant"] == name]
        per = [sum(h[i] for h in mine) for i in range(len(FACTS))]
        print(f"{name} | {sum(per)}/{len(mine) * len(FACTS)} | " + " | ".join(f"{p}/{len(mine)}" for p in per))


if __name__ == "__main__":
    main()
