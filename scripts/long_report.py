"""A long generated report with three planted facts (near its start, middle and end): `icecache
qa` asks for each, then `icecache summarize` runs over the same document, all through one
document cache (the first command prefills and saves the document, the others load it).

    python scripts/long_report.py --tokens 100000 [--keep DIR] [--qa-only] [-- more CLI flags]

Prints one JSON object: the prompt length, the prefill mode and positions the run chose, each
fact's question, expected answer, the answer given and whether it contains the expected words,
the summary, and the seconds of each command. ``--keep DIR`` keeps the document and the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from icecache.evals.suite import REPORT_FACTS as FACTS  # the report's planted facts
from icecache.evals.suite import answered as found
from icecache.evals.suite import report_document as document


def cli(args: list[str]) -> tuple[dict, dict, float]:
    cmd = [sys.executable, "-m", "icecache_cli", *args, "--json", "--stats"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    took = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"{args[0]} failed ({r.returncode}): {r.stderr.strip()[-800:]}")
    return json.loads(r.stdout), json.loads(r.stderr.strip().splitlines()[-1]), took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--keep", type=Path, default=None, help="folder for the document and the cache (kept)")
    ap.add_argument("--qa-only", action="store_true", help="skip the summary")
    ap.add_argument("extra", nargs="*", help="more CLI flags for every command, after --")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = a.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        doc, cache = where / "report.txt", where / "cache"
        doc.write_text(document(a.tokens, a.seed))
        common = ["--doc-cache", str(cache), *a.extra]
        questions = [x for _s, _f, q, _a in FACTS for x in ("-q", q)]
        qa_out, qa_stats, qa_s = cli(["qa", str(doc), *questions, "--max-new-tokens", "24", *common])
        if a.qa_only:
            sum_out, sum_stats, sum_s = {"output": ""}, {}, 0.0
        else:
            sum_out, sum_stats, sum_s = cli(["summarize", str(doc), *common])
    facts = [{"share": s, "question": q, "expected": e, "answer": ans.strip(), "found": found(ans, e)}
             for (s, _f, q, e), ans in zip(FACTS, qa_out["output"], strict=True)]
    print(json.dumps({
        # qa's stats add up its questions' prompts: one question's prompt is about a third
        "prompt_tokens_per_question": (qa_stats.get("prompt_tokens") or 0) // len(FACTS), "prefill": qa_stats.get("prefill"),
        "positions": qa_stats.get("positions"), "method": qa_stats.get("method"), "facts": facts, "found": sum(f["found"] for f in facts),
        "qa_seconds": round(qa_s, 1), "summarize_seconds": round(sum_s, 1),
        "qa_prefill_s": qa_stats.get("prefill_s"), "summarize_prefill_s": sum_stats.get("prefill_s"),
        "summarize_cached_tokens": sum_stats.get("prefix_cached_tokens", 0),
        "peak_rss_bytes": max(qa_stats.get("peak_rss_bytes", 0), sum_stats.get("peak_rss_bytes", 0)),
        "summary": sum_out["output"].strip(),
    }, indent=1))


if __name__ == "__main__":
    main()
