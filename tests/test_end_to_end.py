"""End to end on the embedded model (CPU, greedy decoding)."""

from __future__ import annotations

import json

import pytest
import torch

from icecache.generation import Session
from icecache.prompts import render, summarize_messages
from icecache.tasks import Runner

from .conftest import EXAMPLE, run_cli

CAT_DOC = (
    "Notes from the lighthouse.\n\nThe keeper of the Kessel Bay lighthouse lives alone with a "
    "grey cat. The cat is named Biscuit. Biscuit sleeps on the spiral stairs every afternoon.\n"
)


def test_qa_answers_a_stated_fact():
    r = run_cli(["qa", "-", "-q", "What is the name of the cat?"], stdin=CAT_DOC.encode())
    assert r.returncode == 0, r.stderr.decode()
    assert "Biscuit" in r.stdout.decode()


def test_summarize_returns_text_and_json_has_fields():
    r = run_cli(["summarize", str(EXAMPLE), "--json", "--max-new-tokens", "48", "--quiet"])
    assert r.returncode == 0, r.stderr.decode()
    assert r.stderr == b""  # --quiet
    lines = r.stdout.decode().strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    for key in ("task", "output", "tokens_in", "tokens_out", "model", "method", "budget", "seconds"):
        assert key in obj
    assert obj["task"] == "summarize" and obj["method"] == "ice"  # IceCache is the default
    assert obj["budget"] == 256  # the cpu profile's
    assert len(obj["output"].split()) >= 5
    assert 0 < obj["tokens_out"] <= 48 and obj["tokens_in"] > 500


def test_stdin_without_file_argument_and_cot_json():
    problem = b"Tom has 3 boxes with 12 apples in each box. How many apples does Tom have?"
    r = run_cli(["cot", "--json", "--max-new-tokens", "96"], stdin=problem)
    assert r.returncode == 0, r.stderr.decode()
    obj = json.loads(r.stdout)
    assert obj["task"] == "cot" and "answer" in obj and obj["output"]
    assert obj["answer"] != "" and obj["answer"] in obj["output"].replace(",", "")


def test_document_too_long_fails_with_both_lengths(tmp_path):
    doc = tmp_path / "long.txt"
    doc.write_text("The harbor was quiet that night. " * 1500)
    r = run_cli(["summarize", str(doc), "--method", "full"])  # full: the trained context is its limit
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b""
    assert "document too long" in err and "8192" in err and "Traceback" not in err


def test_several_questions_reuse_the_document_prefix(loaded, cpu_settings):
    questions = ["What is the name of the cat?", "Where does the cat sleep?", "What is the name of the cat?"]
    runner = Runner(loaded, cpu_settings)
    result = runner.qa(CAT_DOC, questions, max_new_tokens=24)
    _, second, _ = result.stats
    assert second.tokens_prefilled < second.tokens_in  # the document came from the cache
    # An answer computed on a reused prefix equals the one computed from scratch.
    assert result.output[2] == result.output[0]
    fresh = Runner(loaded, cpu_settings).qa(CAT_DOC, questions[1:2], max_new_tokens=24)
    assert fresh.output[0] == result.output[1]


def test_chunked_prefill_matches_one_shot(loaded, cpu_settings):
    ids = render(loaded.tokenizer, summarize_messages(EXAMPLE.read_text()))
    one = Session(loaded, cpu_settings.replace(chunk_size=4096))
    chunked = Session(loaded, cpu_settings.replace(chunk_size=64))
    with torch.inference_mode():
        one._start(ids)
        chunked._start(ids)
        a = one.forward(ids)
        for lo in range(0, len(ids), 64):
            b = chunked.forward(ids[lo : lo + 64])
    torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    k1 = one.cache.layers[5].keys
    k2 = chunked.cache.layers[5].keys
    torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)


def test_summarize_with_ice_method_and_json_stats():
    r = run_cli(["summarize", str(EXAMPLE), "--method", "ice", "--budget", "64", "--json",
                 "--max-new-tokens", "40", "--quiet"])
    assert r.returncode == 0, r.stderr.decode()
    obj = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert obj["method"] == "ice" and obj["budget"] == 64
    assert len(obj["output"].split()) >= 5


@pytest.mark.slow
def test_qa_with_ice_several_questions(loaded, cpu_settings):
    """The ice cache cannot be cut back to a prefix: each question gets a fresh prefill. A short
    document fits in the budget, so the answers are exactly those of the full cache."""
    questions = ["What is the name of the cat?", "Where does the cat sleep?"]
    result = Runner(loaded, cpu_settings, "ice").qa(CAT_DOC, questions, max_new_tokens=40)
    assert all(s.tokens_prefilled == s.tokens_in for s in result.stats)
    assert result.output == Runner(loaded, cpu_settings, "full").qa(CAT_DOC, questions, max_new_tokens=40).output
    assert "Biscuit" in result.output[0]
