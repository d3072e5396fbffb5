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
