"""Documents past the embedded model's 8k trained context, end to end (slow: minutes each)."""

from __future__ import annotations

import json

import pytest

from .conftest import run_cli


def _eval(args: list[str], out) -> tuple[dict, str]:
    r = run_cli(["eval", "--tasks", "passkey", "--methods", "ice", "--lengths", "16k", "--n", "2",
                 "--depths", "25,75", "--json", "--out", str(out), *args], timeout=1800)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    rows = {x["budget"]: x for x in json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]}
    return rows, r.stderr.decode()


@pytest.mark.slow
def test_passkey_at_16k_remapped_positions_find_what_true_positions_cannot(tmp_path):
    """Two 16k-token passkey documents (twice the trained context), needles at 25% and 75%.

    The shipped cpu profile (sparse prefill, remapped positions) finds at least one of the two
    keys at budget 256, and more than the same run with true positions finds (docs/results.md,
    session 14: true positions 0 of 5 at 16k and at 32k; remapped 20 of 20 at 16k in session 12).
    Budget 64 shares each case's prefill with 256.
    """
    remapped, err = _eval(["--budgets", "64,256"], tmp_path / "remap")
    assert remapped[256]["n"] == 2 and remapped[64]["n"] == 2
    assert err.count("case 1/2") == 1  # both budgets from one prefill per case
    true, _ = _eval(["--budgets", "256", "--positions", "true"], tmp_path / "true")
    assert remapped[256]["score"] >= 0.5
    assert remapped[256]["score"] > true[256]["score"]


@pytest.mark.slow
def test_qa_finds_facts_at_the_start_middle_and_end_of_a_100k_token_report(tmp_path):
    """`python scripts/long_report.py --tokens 100000`: a generated 100k-token report with three
    planted facts (at 3%, 50% and 97% of it), `icecache qa` with one question per fact on the cpu
    profile as shipped (ice, sparse prefill, remapped positions), then `icecache summarize` of
    the same document from the document cache the qa run saved.

    Must hold: the runs end, sparse and remapped; the summary is English prose (words, not one
    phrase over and over); summarize loaded the document instead of prefilling it again; each
    fact is found and the runs stay within the profile's 16 GiB (the issue's targets: unmet in
    sessions 14-49, met in session 50 with the qa prompt asking for a brief answer: 3 of 3,
    peak RSS 15.3 GB; docs/results.md)."""
    import subprocess
    import sys

    from .conftest import REPO

    r = subprocess.run([sys.executable, str(REPO / "scripts" / "long_report.py"), "--tokens", "100000",
                        "--keep", str(tmp_path)], capture_output=True, text=True, timeout=5400, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["prompt_tokens_per_question"] >= 100_000  # the document and one question
    assert got["prefill"] == "sparse" and got["positions"] == "remap" and got["method"] == "ice"
    assert got["summarize_cached_tokens"] > 99_000
    assert got["summarize_prefill_s"] < 0.25 * got["qa_prefill_s"]
    words = got["summary"].split()
    assert len(words) >= 20
    assert sum(w.strip(".,;:!?\"'()").isalpha() for w in words) >= 0.8 * len(words)
    assert len(set(words)) >= 0.4 * len(words)
    missed = [f"fact at {f['share']:.0%} ({f['expected']!r}; answer {f['answer']!r})"
              for f in got["facts"] if not f["found"]]
    assert not missed, "; ".join(missed)
    assert got["peak_rss_bytes"] < 16 * 2**30, f"peak RSS {got['peak_rss_bytes'] / 2**30:.1f} GiB"
