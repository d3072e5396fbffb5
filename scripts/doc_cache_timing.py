"""Time to first token of `icecache qa` with the document cache: a first run (prefill, saves) and
a second (loads), on one generated document, in one script run.

    python scripts/doc_cache_timing.py --tokens 7600              # full prefill (trained range)
    python scripts/doc_cache_timing.py --tokens 131072 --method ice  # sparse prefill

Prints both runs' prefill seconds (the first token comes from the prefill's logits, so this is
the time to first token after the model is loaded), their ratio, whether the answers are the
same, and the entry's size per token. The cache folder is a fresh temporary one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

NEEDLE = "The harbor master of Kessel Bay is Ingrid Solberg, appointed in the spring."
QUESTION = "Who is the harbor master of Kessel Bay?"


def document(tokens: int) -> str:
    from icecache.textgen import generated_text

    words = int(tokens * 0.75)  # about 1.33 tokens per word of this prose with the embedded tokenizer
    text = generated_text(words, seed=11)
    mid = len(text) // 2
    return text[:mid] + " " + NEEDLE + " " + text[mid:]


def qa(doc: Path, cache: Path, method: str, extra: list[str]) -> tuple[dict, dict]:
    cmd = [sys.executable, "-m", "icecache_cli", "qa", str(doc), "-q", QUESTION, "--method", method,
           "--doc-cache", str(cache), "--max-new-tokens", "16", "--json", "--stats", "--quiet", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "NO_COLOR": "1"})
    if r.returncode:
        sys.exit(f"qa failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout), json.loads(r.stderr.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=7600)
    ap.add_argument("--method", default="ice")
    ap.add_argument("extra", nargs="*", help="more qa flags, after --")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        doc = Path(tmp) / "doc.txt"
        doc.write_text(document(a.tokens))
        cache = Path(tmp) / "cache"
        out1, st1 = qa(doc, cache, a.method, a.extra)
        out2, st2 = qa(doc, cache, a.method, a.extra)
        size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    tokens = st1["prompt_tokens"]
    print(json.dumps({"prompt_tokens": tokens, "method": a.method, "prefill": st1["prefill"],
                      "first_prefill_s": st1["prefill_s"], "second_prefill_s": st2["prefill_s"],
                      "ratio": round(st2["prefill_s"] / st1["prefill_s"], 4),
                      "second_cached_tokens": st2["prefix_cached_tokens"],
                      "answers_identical": out1["output"] == out2["output"], "answer": out1["output"][0],
                      "cache_bytes": size, "bytes_per_token": round(size / max(1, st2["prefix_cached_tokens"]))}))


if __name__ == "__main__":
    main()
