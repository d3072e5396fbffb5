"""Shared fixtures: the embedded model loaded once, and a runner for the real CLI process."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The document cache stays off unless a test names its folder (it would carry prefills between
# tests and runs of the suite).
os.environ["ICECACHE_DOC_CACHE"] = "off"
EXAMPLE = REPO / "docs" / "examples" / "harbor-report.txt"


def _one_core_per_worker() -> None:
    """Under pytest-xdist, pin each worker (and the CLI processes it starts, which inherit the
    CPU set and size their thread pool by it) to its own core, as far as the cores go. Two
    workers of two torch threads each on two cores oversubscribe them, and torch's thread pool
    then waits on itself: a test that takes 20 s alone took 80-160 s in `make test`."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return
    per = len(cores) // count
    index = int(worker[2:])
    mine = set(cores[index * per:(index + 1) * per])
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))


_one_core_per_worker()


@pytest.fixture(scope="session")
def quick_profile(tmp_path_factory) -> str:
    """The cpu profile with ``prefill_queries: 4``: a sparse prefill steps the prompt's last 8
    tokens one by one instead of 32, for CLI tests whose prompts are a few hundred tokens; and
    ``dense_until: 0``, so that ice keeps its pages on those prompts (a short run is dense
    otherwise)."""
    import yaml

    data = yaml.safe_load((REPO / "profiles" / "cpu.yaml").read_text(encoding="utf-8"))
    data.update(name="cpu-quick", prefill_queries=4, dense_until=0)
    path = tmp_path_factory.mktemp("profiles") / "cpu-quick.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def cpu_settings():
    from icecache.config import resolve_settings

    # ice's pages on short prompts too; dense layers and prompts in float32 on any CPU
    # (tests/test_dense_kv.py and test_prompt_compute.py take bfloat16)
    return resolve_settings("cpu").replace(dense_until=0, dense_kv="model", prompt_compute="model")


@pytest.fixture(scope="session")
def loaded(cpu_settings):
    """The embedded model (converted once into the user cache, as a user's first run does), with
    float weights: the reference the cache tests compare against (the cpu profile's ``weights:
    auto`` takes int4 for it, whose one-row products round to bfloat16; tests/test_weights.py)."""
    from icecache.models import load_model

    return load_model(None, cpu_settings.replace(weights="float"))


def run_cli(args: list[str], stdin: bytes | None = b"", env: dict | None = None, timeout: int = 300):
    """Run ``python -m icecache_cli ARGS`` as a real process; return the CompletedProcess."""
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "icecache_cli", *args],
        input=stdin,
        capture_output=True,
        env=full_env,
        cwd=REPO,
        timeout=timeout,
    )


def on_pty(args: list[str], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env: dict | None = None,
           until: str | None = None, then=None, timeout: int = 600):
    """Run the CLI with stderr on a pseudo-terminal (NO_COLOR unset unless ``env`` sets it);
    once ``until`` shows on the screen, ``then(proc)`` runs. Returns (exit code, screen text,
    stdout bytes, or None when ``stdout`` is not a pipe)."""
    master, slave = pty.openpty()
    full_env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "40"}
    full_env.pop("NO_COLOR", None)
    full_env.update(env or {})
    proc = subprocess.Popen([sys.executable, "-m", "icecache_cli", *args], stdin=stdin, stdout=stdout,
                            stderr=slave, env=full_env, cwd=REPO)
    os.close(slave)
    screen, fired = b"", False
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        screen += chunk
        if until and not fired and until.encode() in screen:
            fired = True
            then(proc)
    out = proc.stdout.read() if proc.stdout is not None else None
    proc.wait(timeout=60)
    os.close(master)
    return proc.returncode, screen.decode("utf8", "replace"), out
