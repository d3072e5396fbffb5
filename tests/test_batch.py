"""icecache batch: bad documents, exit codes, resume after SIGTERM, shards, stdin, pipes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from icecache import batch as b

from .conftest import REPO, run_cli

GOOD = "Report {i}. The ferry to the island number {i} left at {h} o'clock with {p} passengers on board.\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    (d / "sub").mkdir()
    for i in range(17):
        target = d / "sub" if i % 3 == 0 else d
        (target / f"doc{i:02d}.txt").write_text(GOOD.format(i=i, h=6 + i % 12, p=10 * i + 3))
    (d / "binary.txt").write_bytes(b"\x00\x01\x02binary")
    (d / "empty.txt").write_text("   \n")
    (d / "long.txt").write_text("The harbor was quiet that night. " * 4000)  # far over 8k tokens
    (d / "notes.md").write_text("not matched by the glob")
    return d


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_folder_with_bad_documents(folder, tmp_path):
    out = tmp_path / "r.jsonl"
    # --method full: its limit is the model's trained context, so long.txt is refused
    r = run_cli(["batch", str(folder), "--method", "full", "--max-new-tokens", "3", "--out", str(out)])
    assert r.returncode == b.EXIT_SOME_FAILED, r.stderr.decode()
    recs = records(out.read_text())
    assert len(recs) == 20 and r.stdout == b""
    errors = {os.path.basename(x["path"]): x["error"] for x in recs if x["error"]}
    assert set(errors) == {"binary.txt", "empty.txt", "long.txt"}
    assert "binary" in errors["binary.txt"] and "empty" in errors["empty.txt"] and "too long" in errors["long.txt"]
    good = [x for x in recs if not x["error"]]
    assert len(good) == 17 and all(x["output"] and x["tokens_out"] > 0 and x["hash"] for x in good)
    assert all(x["task"] == "summarize" and x["method"] == "full" for x in recs)
    # Rerun: everything is done already, nothing appended; the three inputs that have only
    # error records keep the exit code at 3.
    again = run_cli(["batch", str(folder), "--method", "full", "--max-new-tokens", "3", "--out", str(out)])
    assert again.returncode == b.EXIT_SOME_FAILED and len(records(out.read_text())) == 20
    assert "(3 of them have only error records)" in again.stderr.decode()


def test_sigterm_then_resume_gives_each_document_once(folder, tmp_path):
    out = tmp_path / "r.jsonl"
    # --method full refuses long.txt at once (ice, the default, would prefill its 32k tokens)
    args = [sys.executable, "-m", "icecache_cli", "batch", str(folder), "--method", "full", "--max-new-tokens", "4",
            "--out", str(out), "--quiet"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, err = proc.wait(60), proc.stderr.read()
    assert (code, err) == (143, b"icecache: error: terminated\n")  # even with --quiet: it is an error
    first = records(out.read_text())  # every line parses
    assert 3 <= len(first) < 20
    r = run_cli(["batch", str(folder), "--method", "full", "--max-new-tokens", "4", "--out", str(out), "--quiet"])
    assert r.returncode == b.EXIT_SOME_FAILED
    paths = [x["path"] for x in records(out.read_text())]
    assert len(paths) == 20 and len(set(paths)) == 20


def test_cut_last_line_is_dropped_on_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"path": "a", "hash": "h", "task": "summarize", "question": null}\n{"path": "b", "ha')
    rf = b.ResultsFile(out)
    rf.close()
    assert out.read_text().count("\n") == 1 and rf.done == {(b.resolved("a"), "h", "summarize", None)}
    assert rf.failed == set()  # no error in the record


def test_shards_are_disjoint_and_cover(folder):
    inputs = b.list_inputs([str(folder)], "*.txt")
    assert len(inputs) == 20 and not any(p.endswith(".md") for p in inputs)
    parts = [[p for p in inputs if b.in_shard(p, (i, 4))] for i in range(4)]
    assert sorted(sum(parts, [])) == sorted(inputs)
    assert sum(len(p) for p in parts) == len(inputs)
    assert all(parts)  # 20 paths over 4 shards: none empty here
    with pytest.raises(Exception, match="I/N"):
        b.parse_shard("2")
    with pytest.raises(Exception, match="0 <= I < N"):
        b.parse_shard("4/4")


def test_paths_from_stdin_and_head(folder):
    listing = "\n".join(str(folder / f"doc{i:02d}.txt") for i in (1, 2, 4)) + "\n"
    r = run_cli(["batch", "-", "--max-new-tokens", "2", "--quiet"], stdin=listing.encode())
    assert r.returncode == 0, r.stderr.decode()
    recs = records(r.stdout.decode())
    assert [os.path.basename(x["path"]) for x in recs] == ["doc01.txt", "doc02.txt", "doc04.txt"]
    cmd = (f"printf '%s\\n' {folder}/doc01.txt {folder}/doc02.txt {folder}/doc04.txt | "
           f"{sys.executable} -m icecache_cli batch - --max-new-tokens 2 --quiet | head -n 1; "
           "echo \"status ${PIPESTATUS[1]}\"")
    p = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, timeout=300)
    lines = p.stdout.decode().splitlines()
    assert json.loads(lines[0])["path"].endswith("doc01.txt") and lines[-1] == "status 0"
    assert b"Traceback" not in p.stderr


def test_usage_errors():
    assert run_cli(["batch", ".", "--task", "translate"]).returncode == 2
    assert run_cli(["batch", ".", "--task", "qa"]).returncode == 2
    assert run_cli(["batch", ".", "--shard", "5/2"]).returncode == 2
