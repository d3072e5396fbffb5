"""The bad-input matrix, run through the real ``icecache`` process.

Each case: a non-zero exit code (2 for usage errors, 1 for runtime failures), one line on
stderr that says what is wrong, nothing on stdout and no traceback. None of these load a model.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import EXAMPLE, REPO, run_cli


def _check(r, code: int, *needles: str) -> None:
    err = r.stderr.decode()
    assert r.returncode == code, err
    assert r.stdout == b""
    assert "Traceback" not in err
    assert err.startswith("icecache: error: "), err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "empty.txt").write_bytes(b"")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (d / "latin1.txt").write_bytes("Résumé of the year".encode("latin-1"))
    return d


@pytest.mark.parametrize(
    "name,message",
    [
        ("missing.txt", "no such file"),
        (".", "is a directory"),
        ("empty.txt", "is empty"),
        ("binary.bin", "binary file"),
        ("latin1.txt", "not UTF-8 text"),
    ],
)
def test_bad_file(files, name, message):
    path = files / name
    _check(run_cli(["summarize", str(path)]), 2, str(path), message)


def test_bad_file_in_qa_and_cot(files):
    _check(run_cli(["qa", str(files / "empty.txt"), "-q", "why?"]), 2, "is empty")
    _check(run_cli(["cot", str(files / "binary.bin")]), 2, "binary file")


def test_empty_stdin():
    _check(run_cli(["summarize", "-"], stdin=b""), 2, "stdin: is empty")
    _check(run_cli(["summarize"], stdin=b""), 2, "stdin: is empty")  # a pipe and no FILE


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(files):
    p = files / "locked.txt"
    p.write_text("secret")
    p.chmod(0)
    _check(run_cli(["summarize", str(p)]), 2, "permission denied")


def test_method_not_available_yet_and_unknown():
    _check(run_cli(["summarize", str(EXAMPLE), "--method", "magic"]), 2, "unknown method 'magic'")


def test_bad_budget_flag_and_profile():
    _check(run_cli(["summarize", str(EXAMPLE), "--budget", "100"]), 2, "--budget must be a positive multiple")
    _check(run_cli(["summarize", str(EXAMPLE), "--profile", "nope"]), 2, "unknown profile 'nope'")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_profile_without_cuda_is_runtime_error():
    _check(run_cli(["summarize", str(EXAMPLE), "--profile", "h100-80gb"]), 1, "CUDA is not available")


def test_missing_model_file_and_folder(tmp_path):
    _check(run_cli(["summarize", str(EXAMPLE), "--model", str(tmp_path / "x.gguf")]), 1, "does not exist")
    _check(run_cli(["summarize", str(EXAMPLE), "--model", str(tmp_path)]), 1, "has no config.json")


def test_usage_errors_from_the_parser_exit_2():
    r = run_cli(["qa", str(EXAMPLE)])  # no question
    assert r.returncode == 2 and r.stdout == b"" and "question" in r.stderr.decode()
    r = run_cli(["summarize", str(EXAMPLE), "--max-new-tokens", "0"])
    assert r.returncode == 2 and r.stdout == b""
    r = run_cli(["frobnicate"])
    assert r.returncode == 2 and r.stdout == b""


def test_closed_stdout_exits_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: the first write fails with EPIPE
    try:
        r = subprocess.run(
            [sys.executable, "-m", "icecache_cli", "profiles"],
            stdout=write_end, stderr=subprocess.PIPE, cwd=REPO, timeout=120,
        )
    finally:
        os.close(write_end)
    assert r.returncode == 0
    assert r.stderr == b""


def test_version_and_help():
    r = run_cli(["--version"])
    assert r.returncode == 0 and r.stdout.decode().startswith("icecache ")
    r = run_cli(["summarize", "--help"])
    assert r.returncode == 0 and "--max-new-tokens" in r.stdout.decode()


@pytest.mark.parametrize("args,code", [
    (["--help"], 0),
    (["--version"], 0),
    (["qa", "missing-file.txt", "-q", "Who?"], 2),
    (["summarize", "--budget", "7", str(EXAMPLE)], 2),
    (["batch", "missing-folder", "--task", "qa"], 2),
    (["bench", "--ctx", "1k", "--methods", "nope"], 2),
    (["cache", "list"], 0),
])
def test_help_and_input_errors_answer_without_torch(args, code, tmp_path):
    """``--help``, ``--version`` and the checks that need no model answer before torch,
    transformers and numba are imported (seconds on a small machine): the process's modules at
    its exit."""
    from icecache.config import GPU_DEVICE_FILES

    if any(os.path.exists(p) for p in GPU_DEVICE_FILES):
        pytest.skip("a GPU driver is present: the default profile asks torch for the device")
    probe = ("import atexit, os, sys\n"
             "heavy = lambda: ','.join(m for m in ('torch', 'transformers', 'numba') if m in sys.modules)\n"
             "atexit.register(lambda: os.write(2, ('\\nheavy: ' + heavy() + '\\n').encode()))\n"
             "from icecache_cli.app import main\n"
             f"sys.argv = ['icecache', *{args!r}]\n"
             "main()\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=REPO, timeout=120,
                       env={**os.environ, "NO_COLOR": "1", "ICECACHE_DOC_CACHE": str(tmp_path)})
    err = r.stderr.decode()
    assert r.returncode == code, err
    assert err.rsplit("heavy: ", 1)[1].strip() == "", err


def test_an_error_raised_while_unwinding_from_sigterm_still_ends_as_terminated(monkeypatch, capsys):
    """A signal's exception can be replaced on its way out (a lock it left half released raises
    again in a ``finally``): the run still ends with the signal's line and exit code, not as an
    internal error."""
    import signal
    import time

    from icecache_cli import app as cli

    def command(args, standalone_mode):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        finally:
            raise RuntimeError("release unlocked lock")

    monkeypatch.setattr(cli, "app", command)
    monkeypatch.setattr(cli, "_stop_signal", [])
    before = signal.signal(signal.SIGTERM, cli._on_signal)
    try:
        assert cli._run([]) == 143
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err == "icecache: error: terminated\n"
    # without a signal the same error is an internal error, exit code 1
    monkeypatch.setattr(cli, "_stop_signal", [])
    monkeypatch.setattr(cli, "app", lambda args, standalone_mode: (_ for _ in ()).throw(RuntimeError("bug")))
    assert cli._run([]) == 1
    assert "internal error: RuntimeError: bug" in capsys.readouterr().err
