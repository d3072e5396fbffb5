"""``icecache batch --engine ray`` on a local Ray instance (slow; needs the ray extra, which
``make test-slow`` installs): the same records as the local engine, nothing lost when a worker
process is killed mid-run, nothing computed again on a rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import REPO, run_cli

pytestmark = pytest.mark.slow
pytest.importorskip("ray")

FACT = "Entry {k} of report {i}: the ferry number {k} left the harbor at {h} o'clock with {p} passengers."
SAME = ("path", "hash", "task", "question", "output", "tokens_in", "tokens_out", "method", "budget", "error")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """12 documents of very unequal length (about 30 to 2400 tokens), one empty, one binary."""
    d = tmp_path_factory.mktemp("ray-docs")
    for i, entries in enumerate([1, 2, 3, 5, 8, 12, 20, 35, 60, 100]):
        text = " ".join(FACT.format(k=k, i=i, h=6 + k % 12, p=10 * k + i) for k in range(entries))
        (d / f"report{i:02d}.txt").write_text(text + "\n")
    (d / "empty.txt").write_text("")
    (d / "binary.txt").write_bytes(b"\x00\x01\x02\xff binary")
    return d


@pytest.fixture(scope="module")
def one_thread(tmp_path_factory):
    """The cpu profile with one thread: the local engine computes as a 1-CPU actor does."""
    text = (REPO / "profiles" / "cpu.yaml").read_text().replace("cpu_threads: 0", "cpu_threads: 1")
    path = tmp_path_factory.mktemp("profile") / "cpu1.yaml"
    path.write_text(text)
    return str(path)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_doc(recs: list[dict]) -> dict:
    return {os.path.basename(r["path"]): tuple(r[k] for k in SAME[1:]) for r in recs}


RAY = ["--engine", "ray", "--workers", "2", "--cpus-per-worker", "1"]


def test_ray_engine_equals_local_and_survives_a_killed_worker(folder, one_thread, tmp_path):
    common = ["batch", str(folder), "--max-new-tokens", "8", "--profile", one_thread]
    local_out, ray_out = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    r = run_cli([*common, "--out", str(local_out)], timeout=900)
    assert r.returncode == 3, r.stderr.decode()  # the empty and the binary document failed
    local = records(local_out)
    assert len(local) == 12 and sum(x["error"] is not None for x in local) == 2

    # The Ray engine, one worker process killed (SIGKILL) once the first records are in.
    proc = subprocess.Popen([sys.executable, "-m", "icecache_cli", *common, *RAY, "--out", str(ray_out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    killed = None
    deadline = time.time() + 600
    while killed is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
        if ray_out.exists() and ray_out.read_text().count("\n") >= 2:
            pids = subprocess.run(["pgrep", "-f", "ray::_Worker"], capture_output=True, text=True).stdout.split()
            if pids:
                killed = int(pids[0])
                os.kill(killed, signal.SIGKILL)
    _, err = proc.communicate(timeout=900)
    assert killed is not None, "no worker process was found to kill: " + err.decode()
    assert proc.returncode == 3, err.decode()
    got = records(ray_out)
    assert len(got) == 12  # every document once: the killed worker's document was run again
    assert by_doc(got) == by_doc(local)
    assert "a worker died while processing" in err.decode()  # the retry path ran
    assert "Traceback" not in err.decode()

    # A rerun into the same output computes nothing.
    again = run_cli([*common, *RAY, "--out", str(ray_out)], timeout=300)
    assert again.returncode == 3 and len(records(ray_out)) == 12
    assert "12 documents already done" in again.stderr.decode()


def test_sigterm_stops_the_driver_and_its_workers_with_whole_lines(folder, one_thread, tmp_path):
    out = tmp_path / "ray.jsonl"
    args = ["batch", str(folder), "--max-new-tokens", "8", "--profile", one_thread, *RAY, "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "icecache_cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 1):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 143
    assert proc.stderr.read().decode().splitlines()[-1] == "icecache: error: terminated"
    first = records(out)  # every line parses
    assert 1 <= len(first) < 12
    time.sleep(2)
    left = subprocess.run(["pgrep", "-f", "ray::_Worker"], capture_output=True, text=True).stdout.split()
    assert left == []  # the local instance and its workers ended with the driver
    r = run_cli(args, timeout=900)
    assert r.returncode == 3, r.stderr.decode()
    paths = [x["path"] for x in records(out)]
    assert len(paths) == 12 and len(set(paths)) == 12
