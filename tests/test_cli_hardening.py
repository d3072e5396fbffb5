"""Issue 23: every bad input one clean line, checked before the model loads; signals, pipes,
terminals. Real ``icecache`` processes; the model is loaded only where a case needs it.

"Before the model loads" shows as: no "loading" line on stderr (it would precede the error)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from icecache.methods import METHODS

from .conftest import EXAMPLE, REPO, on_pty, run_cli

CLI = [sys.executable, "-m", "icecache_cli"]


def one_error_line(r, code: int, *needles: str) -> str:
    """Exit ``code``, nothing on stdout, exactly one ``icecache: error:`` line, no model loaded."""
    err = r.stderr.decode()
    assert r.returncode == code, err
    assert r.stdout == b"", r.stdout
    assert err.startswith("icecache: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "loading" not in err
    for needle in needles:
        assert needle in err, err
    return err


# -- stdin closed ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["summarize", "-"], ["summarize"], ["qa", "-", "-q", "who?"]])
def test_closed_stdin(args):
    r = subprocess.run(["bash", "-c", 'exec "$@" <&-', "bash", *CLI, *args], cwd=REPO,
                       capture_output=True, env={**os.environ, "NO_COLOR": "1"}, timeout=120)
    one_error_line(r, 2, "stdin is closed")


def test_closed_stdin_in_batch():
    r = subprocess.run(["bash", "-c", 'exec "$@" <&-', "bash", *CLI, "batch", "-"], cwd=REPO,
                       capture_output=True, timeout=120)
    one_error_line(r, 2, "stdin is closed")


# -- parser errors: one line; usage only with --help ----------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["summarize", str(EXAMPLE), "--budget", "abc"], "'--budget'"),
    (["summarize", str(EXAMPLE), "--max-new-tokens", "0"], "'--max-new-tokens'"),
    (["cot", str(EXAMPLE), "--max-new-tokens", "-1"], "'--max-new-tokens'"),
    (["qa", str(EXAMPLE)], "-q/--question"),
    (["batch"], "Missing argument"),
    (["summarize", str(EXAMPLE), "--no-such-flag"], "--no-such-flag"),
    (["bench", "--methods", "full"], "--ctx"),
])
def test_parser_errors_are_one_line(args, needle):
    err = one_error_line(run_cli(args), 2, needle)
    assert "Usage:" not in err and "Try " not in err


def test_help_still_shows_usage_and_every_method():
    r = run_cli(["summarize", "--help"], env={"COLUMNS": "200"})
    out = r.stdout.decode()
    assert r.returncode == 0 and "Usage:" in out
    for m in METHODS.values():  # one line each: the name and its summary together
        assert re.search(rf"^\W*{re.escape(m.name)}: {re.escape(m.summary)}", out, re.M), m.name
    bogus = one_error_line(run_cli(["summarize", str(EXAMPLE), "--method", "bogus"]), 2)
    assert all(name in bogus for name in METHODS)


# -- documents ------------------------------------------------------------------------------------
def test_nul_after_the_first_8k_is_binary(tmp_path):
    p = tmp_path / "late-nul.txt"
    p.write_bytes(b"plain text. " * 2000 + b"\x00" + b"more text")
    one_error_line(run_cli(["summarize", str(p)]), 2, "binary")
    u16 = tmp_path / "nul16.txt"
    u16.write_bytes("text\x00with a NUL".encode("utf-16"))
    one_error_line(run_cli(["summarize", str(u16)]), 2, "binary")


def test_empty_file_on_a_terminal_prints_only_the_error(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_bytes(b"")
    rc, screen, out = on_pty(["summarize", str(p)])
    assert rc == 2 and out == b""
    assert screen.strip() == f"icecache: error: {p}: is empty", screen


# -- batch, before loading ------------------------------------------------------------------------
def test_batch_out_is_a_folder(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    one_error_line(run_cli(["batch", str(tmp_path), "--out", str(tmp_path)]), 2, "--out", "is a folder")


def test_batch_nothing_matches_the_glob(tmp_path):
    (tmp_path / "a.md").write_text("text")
    err = one_error_line(run_cli(["batch", str(tmp_path), "--glob", "*.txt"]), 2, "'*.txt'", str(tmp_path))
    assert "no input files" in err
    one_error_line(run_cli(["batch", "-"], stdin=b"\n"), 2, "stdin is empty")


# -- limits named correctly, before loading -------------------------------------------------------
def test_questions_and_generation_room_checked_before_loading():
    one_error_line(run_cli(["qa", str(EXAMPLE), "-q", "", "-q", "real question"]), 2, "non-empty question")
    # --method full: the model's trained context (8192) is its limit; ice's is the profile's max_context
    err = one_error_line(run_cli(["summarize", str(EXAMPLE), "--method", "full", "--max-new-tokens", "100000"]), 2,
                         "--max-new-tokens 100000", "8192 tokens")
    assert "document too long" not in err
    one_error_line(run_cli(["summarize", str(EXAMPLE), "--max-new-tokens", "300000"]), 2,
                   "--max-new-tokens 300000", "max_context")
    one_error_line(run_cli(["batch", str(EXAMPLE), "--method", "full", "--max-new-tokens", "100000"]), 2,
                   "--max-new-tokens 100000", "8192 tokens")


def test_huge_budget_names_the_budget_and_its_limit():
    # the cpu profile: max_context 262144 less sink (2 pages) and window (8 pages) of 16 tokens
    one_error_line(run_cli(["summarize", str(EXAMPLE), "--budget", "1000000000000"]), 2,
                   "--budget", "at most 261984", "got 1000000000000", "max_context (262144")


def test_empty_profile_file(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing here\n")
    one_error_line(run_cli(["summarize", str(EXAMPLE), "--profile", str(p)]), 2, "is empty")


def test_text_file_named_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("not a model at all\n")
    err = one_error_line(run_cli(["summarize", str(EXAMPLE), "--model", str(p)]), 1, "not a GGUF file")
    assert "converting" not in err and "internal error" not in err


# -- waiting inputs and signals -------------------------------------------------------------------
def test_fifo_nobody_writes_to_says_it_waits(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write_nothing(proc):
        os.close(os.open(fifo, os.O_WRONLY))  # a writer comes and goes: the document is empty

    rc, screen, _ = on_pty(["summarize", str(fifo)], until="waiting for input", then=write_nothing)
    assert "waiting for input on " + str(fifo) in screen
    assert rc == 2 and screen.rstrip().endswith("is empty"), screen


def test_stdin_pipe_nobody_writes_to_says_it_waits():
    r, w = os.pipe()
    try:
        rc, screen, _ = on_pty(["summarize", "-"], stdin=r, until="waiting for input",
                               then=lambda proc: os.close(w))
    finally:
        os.close(r)
    assert "waiting for input on stdin" in screen and rc == 2 and "stdin: is empty" in screen


def blocked_on_read(pid: int, limit: float = 90.0) -> None:
    """Wait until process ``pid`` sleeps in a pipe read (Linux: /proc/PID/wchan), at most
    ``limit`` seconds; elsewhere, 3 seconds (a busy machine can take longer to start Python)."""
    wchan = f"/proc/{pid}/wchan"
    if not os.path.exists(wchan):
        time.sleep(3)
        return
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            if "pipe_read" in open(wchan).read():
                time.sleep(0.3)  # the signal handlers are set before the read
                return
        except OSError:
            return
        time.sleep(0.1)


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
@pytest.mark.parametrize("args", [["summarize", "-"], ["batch", "-"]])
def test_signals_give_one_consistent_line(args, sig, code, word):
    """A command blocked on its input (no model loaded yet), single or batch: the same line."""
    r, w = os.pipe()
    proc = subprocess.Popen(CLI + args, stdin=r, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    os.close(r)
    try:
        blocked_on_read(proc.pid)  # the interpreter started and blocks reading stdin
        assert proc.poll() is None
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(w)
    assert proc.returncode == code and out == b""
    assert err.decode() == f"icecache: error: {word}\n"


def test_sigint_during_shutdown_gives_no_traceback():
    """A Ctrl-C that lands in an atexit callback (as one did in torch's, right at the end of a
    cot run): no 'Exception ignored ... Traceback', exit 130."""
    script = (
        "import atexit, os, signal, time\n"
        "from icecache_cli.app import main\n"
        "def late():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "atexit.register(late)\n"
        "main(['profiles'])\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 130 and "Traceback" not in err and "Exception ignored" not in err, err
    assert err == "icecache: error: interrupted\n" and b"cpu" in r.stdout


# -- cases that need the model ----------------------------------------------------------------------
def test_batch_encodings_budget_resume_by_resolved_path_and_old_errors(tmp_path):
    """UTF-8 (with and without BOM), UTF-16 and UTF-32 with BOM read the same; a late NUL is
    binary; --budget with full is warned about and not reported; a rerun spelled differently
    resumes; its old error record keeps exit 3."""
    d = tmp_path / "docs"
    d.mkdir()
    text = "The ferry to the island left at six with forty passengers. Café au lait was served.\n"
    (d / "u8.txt").write_bytes(text.encode())
    (d / "u8bom.txt").write_bytes(text.encode("utf-8-sig"))
    (d / "u16.txt").write_bytes(text.encode("utf-16"))
    (d / "u32.txt").write_bytes(text.encode("utf-32"))
    (d / "late-nul.txt").write_bytes(text.encode() * 200 + b"\x00")
    out = tmp_path / "r.jsonl"
    args = ["--out", str(out), "--max-new-tokens", "1", "--method", "full", "--budget", "64"]
    r = run_cli(["batch", os.path.relpath(d, REPO), *args])
    err = r.stderr.decode()
    assert r.returncode == 3, err
    assert "icecache: warning: --budget 64 has no effect with --method full" in err
    recs = {os.path.basename(x["path"]): x for x in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == ["late-nul.txt", "u16.txt", "u32.txt", "u8.txt", "u8bom.txt"]
    assert "binary" in recs.pop("late-nul.txt")["error"]
    assert all(x["error"] is None and x["budget"] is None for x in recs.values())
    assert len({x["tokens_in"] for x in recs.values()}) == 1  # the same text, whatever the encoding
    again = run_cli(["batch", str(d.resolve()), *args])
    assert again.returncode == 3, again.stderr.decode()
    assert len(out.read_text().splitlines()) == 5  # nothing recomputed
    assert "5 documents already done" in again.stderr.decode() and "1 of them" in again.stderr.decode()


def test_text_streams_into_pipes_and_survives_ctrl_c():
    """stdout and stderr both pipes: answers arrive as generated; a Ctrl-C keeps what came."""
    questions = [x for i in range(8) for x in ("-q", f"What happened in year {1900 + i}?")]
    proc = subprocess.Popen(CLI + ["qa", str(EXAMPLE), *questions, "--max-new-tokens", "24"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    first = b""
    while not re.search(rb"\nA: \S", first):  # the first answer's first generated text
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, first
        first += chunk
    assert proc.poll() is None  # still generating: the text was not held until the end
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    out = (first + rest).decode()
    assert proc.returncode == 130, err.decode()
    assert out.startswith("Q: What happened in year 1900?\nA: ")
    assert err.decode().splitlines()[-1] == "icecache: error: interrupted"
    assert "Traceback" not in err.decode()


def test_no_color_means_no_styles_on_a_terminal():
    """Under NO_COLOR the panel and status lines carry no colour or style codes (the panel may
    still move the cursor). Also: --budget with full is warned about, and not reported."""
    rc, screen, out = on_pty(["summarize", str(EXAMPLE), "--max-new-tokens", "2", "--method", "full",
                              "--budget", "64", "--json"], env={"NO_COLOR": "1"})
    assert rc == 0 and json.loads(out)["budget"] is None  # full ran without one: none reported
    assert "icecache: warning: --budget 64 has no effect with --method full" in screen
    assert "phase" in screen and "model ready" in screen  # the panel and a status line were there
    assert not re.search(r"\x1b\[[0-9;]*m", screen), repr(screen[:500])


def test_no_color_console_control():
    import io

    from icecache_cli import output

    for env, styled in (("", True), ("1", False)):
        os.environ["NO_COLOR"] = env
        try:
            con = output.stderr_console(file=io.StringIO(), force_terminal=True)
        finally:
            os.environ["NO_COLOR"] = "1"
        con.print("x", style="bold dim")
        assert bool(re.search(r"\x1b\[[0-9;]*m", con.file.getvalue())) == styled


def test_full_on_a_document_that_cannot_fit_in_memory():
    r = run_cli(["summarize", str(EXAMPLE), "--method", "full", "--quiet"],
                env={"ICECACHE_MEM_AVAILABLE_GIB": "0.001"})
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b"" and err.count("\n") == 1, err
    assert re.match(r"icecache: error: --method full for \d+ tokens needs [\d.]+ GiB, 0\.0 GiB available", err), err


def test_bench_rows_that_cannot_fit_are_skipped_and_printed_as_measured(tmp_path):
    r = run_cli(["bench", "--ctx", "300", "--methods", "full,ice", "--json", "--out", str(tmp_path),
                 "--decode-steps", "1"], env={"ICECACHE_MEM_AVAILABLE_GIB": "0.001"})
    assert r.returncode == 0, r.stderr.decode()
    lines = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert [x["method"] for x in lines[:-1]] == ["full", "ice"]  # one line per row, as measured
    assert lines[-1]["results"] == lines[:-1]
    for row in lines[:-1]:
        assert row["status"] == "skipped" and re.search(r"needs [\d.]+ GiB, 0\.0 GiB available", row["reason"])
        assert row["tpot_ms"] is None
    assert [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()] == lines[:-1]
    assert "full at 300 tokens: skipped" in r.stderr.decode()
