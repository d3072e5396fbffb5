"""Documents past the embedded model's 8k trained context, end to end (slow: minutes each)."""

from __future__ import annotations

import json

import pytest

from .conftest import run_cli


@pytest.mark.slow
def test_passkey_at_16k_with_ice_and_remapped_positions(tmp_path):
    """Two 16k-token passkey documents (twice the trained context), at depths 25% and 75%: the
    shipped cpu profile (sparse prefill, remapped positions) finds the key at budget 256; the
    same run at budget 64 shares each prefill (one prefill per case for both budgets)."""
    r = run_cli(["eval", "--tasks", "passkey", "--methods", "ice", "--budgets", "64,256",
                 "--lengths", "16k", "--n", "2", "--depths", "25,75", "--json", "--out", str(tmp_path)],
                timeout=1800)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    rows = {x["budget"]: x for x in json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]}
    assert rows[256]["score"] == 1.0 and rows[256]["n"] == 2
    assert 0.0 <= rows[64]["score"] <= 1.0 and rows[64]["n"] == 2
    assert r.stderr.decode().count("case 1/2") == 1  # both budgets from one prefill
