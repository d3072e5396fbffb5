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
    keys at budget 256, and more than the same run with true positions finds (0 of 5 in
    docs/results.md; 9 of 10 remapped). The issue's target, every key, is not met yet: one of
    these two cases is missed. Budget 64 shares each case's prefill with 256.
    """
    remapped, err = _eval(["--budgets", "64,256"], tmp_path / "remap")
    assert remapped[256]["n"] == 2 and remapped[64]["n"] == 2
    assert err.count("case 1/2") == 1  # both budgets from one prefill per case
    true, _ = _eval(["--budgets", "256", "--positions", "true"], tmp_path / "true")
    assert remapped[256]["score"] >= 0.5
    assert remapped[256]["score"] > true[256]["score"]


@pytest.mark.slow
def test_qa_over_a_100k_token_document_then_again_from_the_document_cache(tmp_path):
    """A generated 100k-token report with one planted fact, `icecache qa` end to end on the cpu
    profile (ice, sparse prefill, remapped positions): it runs, stays within memory, answers,
    and the same question again loads the document's saved state and answers the same."""
    from icecache.textgen import generated_text

    text = generated_text(77000, seed=3)  # about 1.33 tokens per word: 102k tokens
    mid = len(text) // 2
    doc = tmp_path / "report.txt"
    doc.write_text(text[:mid] + " The harbor master of Kessel Bay is Ingrid Solberg. " + text[mid:])
    args = ["qa", str(doc), "-q", "Who is the harbor master of Kessel Bay?", "--max-new-tokens", "16",
            "--json", "--stats", "--doc-cache", str(tmp_path / "cache")]
    runs = [run_cli(args, timeout=3000) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr.decode()[-2000:]
    stats = [json.loads(r.stderr.decode().strip().splitlines()[-1]) for r in runs]
    out = [json.loads(r.stdout) for r in runs]
    assert stats[0]["prompt_tokens"] >= 100_000 and stats[0]["prefill"] == "sparse"
    assert stats[0]["positions"] == "remap"
    assert out[0]["output"][0].strip()  # an answer, not an empty string
    assert stats[0]["peak_rss_bytes"] < 16 * 2**30  # the cpu profile's host_memory_gib
    assert stats[1]["prefix_cached_tokens"] > 99_000 and out[1]["output"] == out[0]["output"]
    assert stats[1]["prefill_s"] < 0.25 * stats[0]["prefill_s"]
