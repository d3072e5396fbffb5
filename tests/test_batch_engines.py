"""What the local and the Ray engine of ``icecache batch`` share: the resume filter, the plan, the
longest-first order, the scheduler's retries; the options' errors. The Ray engine itself runs in
the slow suite (tests/test_batch_ray.py)."""

from __future__ import annotations

import json

from icecache import batch as b
from icecache.batch_ray import MAX_ATTEMPTS, Scheduler, error_records

from .conftest import run_cli


def _folder(tmp_path):
    sizes = {"a.txt": 300, "b.txt": 5000, "c.txt": 40, "d.txt": 5000, "e.txt": 1200}
    for name, n in sizes.items():
        (tmp_path / name).write_text("x" * n)
    return [str(tmp_path / name) for name in sizes], sizes


def _record(path, digest, task="summarize", question=None, error=None):
    return json.dumps({"path": path, "hash": digest, "task": task, "question": question, "error": error})


def test_plan_skips_what_the_output_holds_and_hashes_every_input(tmp_path):
    inputs, sizes = _folder(tmp_path)
    out = tmp_path / "out.jsonl"
    digest = {p: b.content_hash(open(p, "rb").read()) for p in inputs}
    # a.txt done; c.txt done with an error; e.txt done under its old content (it changed since)
    out.write_text("\n".join([_record(inputs[0], digest[inputs[0]]),
                              _record(inputs[2], digest[inputs[2]], error="empty"),
                              _record(inputs[4], "0123456789abcdef")]) + "\n")
    results = b.ResultsFile(out)
    got = b.plan(inputs + [str(tmp_path / "missing.txt")], "summarize", [None], results)
    results.close()
    assert [j.path for j in got.jobs] == [inputs[1], inputs[3], inputs[4], str(tmp_path / "missing.txt")]
    assert got.skipped == 2 and got.failed_before == 1
    assert [j.size for j in got.jobs] == [5000, 5000, 1200, 0]
    assert all(j.digest == digest[j.path] for j in got.jobs[:3]) and got.jobs[3].digest is None


def test_plan_keeps_only_the_questions_not_yet_answered(tmp_path):
    inputs, _ = _folder(tmp_path)
    out = tmp_path / "out.jsonl"
    d0 = b.content_hash(open(inputs[0], "rb").read())
    out.write_text(_record(inputs[0], d0, "qa", "Who?") + "\n")
    results = b.ResultsFile(out)
    got = b.plan(inputs[:1], "qa", ["Who?", "When?"], results)
    assert got.jobs[0].questions == ["When?"] and got.skipped == 0
    assert b.pending(results, inputs[0], d0, "qa", ["Who?"]) == []
    assert b.pending(results, inputs[0], d0, "summarize", [None]) == [None]  # another task
    results.close()


def test_longest_first_keeps_input_order_among_equals():
    jobs = [b.Job(p, "h", [None], size=s) for p, s in [("a", 1), ("b", 9), ("c", 3), ("d", 9), ("e", 0)]]
    assert [j.path for j in b.longest_first(jobs)] == ["b", "d", "c", "a", "e"]


def test_the_scheduler_hands_out_longest_first_and_retries_a_dead_workers_job():
    jobs = [b.Job(p, "h", [None], size=s) for p, s in [("short", 10), ("long", 1000), ("mid", 100)]]
    s = Scheduler(jobs, max_attempts=2)
    first, second = s.next(), s.next()
    assert (first.path, second.path) == ("long", "mid") and s.running == 2
    assert s.died(first)  # back at the front: the next free worker takes it
    assert s.next() is first and first.attempts == 1
    s.finished(second)
    assert not s.died(first)  # its second death: no more attempts
    assert first.attempts == 2 and s.running == 0
    assert s.next().path == "short" and s
    s.finished(jobs[0])
    assert not s and s.next() is None
    s = Scheduler([b.Job("x", "h", [None], size=1)])
    job = s.next()
    s.requeue(job)  # its worker never started: not an attempt
    assert s.next() is job and job.attempts == 0


def test_a_document_whose_worker_kept_dying_gets_one_error_record_per_question():
    class Opts:
        method, budget = "ice", 256

    job = b.Job("/x/doc.txt", "abc", ["Who?", "When?"], attempts=MAX_ATTEMPTS)
    recs = error_records(job, "qa", Opts, "died")
    assert [r["question"] for r in recs] == ["Who?", "When?"]
    assert all(r["error"] == "died" and r["output"] is None and r["hash"] == "abc" for r in recs)
    assert set(recs[0]) >= {"path", "hash", "task", "question", "output", "tokens_in", "tokens_out",
                            "seconds", "method", "budget", "error"}


def test_engine_options_are_checked_before_any_work(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    r = run_cli(["batch", str(tmp_path), "--engine", "spark"])
    assert r.returncode == 2 and b"--engine: 'spark'" in r.stderr
    r = run_cli(["batch", str(tmp_path), "--workers", "2", "--address", "auto"])
    assert r.returncode == 2 and b"--address, --workers only go with --engine ray" in r.stderr
    r = run_cli(["batch", str(tmp_path), "--engine", "ray", "--gpus-per-worker", "1"])
    assert r.returncode == 2 and b"--gpus-per-worker needs a GPU profile" in r.stderr


def test_without_ray_the_error_names_the_extra(tmp_path):
    """Ray hidden from the process: a package on the path whose import fails."""
    (tmp_path / "a.txt").write_text("hello")
    shadow = tmp_path / "shadow"
    (shadow / "ray").mkdir(parents=True)
    (shadow / "ray" / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    r = run_cli(["batch", str(tmp_path), "--engine", "ray"], env={"PYTHONPATH": str(shadow)})
    assert r.returncode == 2
    assert r.stderr.decode().strip() == ("icecache: error: --engine ray needs Ray, an optional extra: "
                                         "pip install 'icecache[ray]'")
