"""``icecache batch --engine ray``: the same jobs as the local engine, run by a pool of Ray actors.

The driver (this process) plans the work with the local engine's resume filter
(:func:`icecache.batch.plan`), orders it longest first, and keeps every actor busy with one
document at a time: an actor that finishes gets the next document, so a folder of unequal
documents balances itself. Each actor loads the model and settings once. The driver reads each
document when it sends it (the workers need no access to the inputs, only to the model) and
writes every record it gets back to the one output, line by line, as the local engine does.

An actor that dies (its process killed, its node lost) is replaced, and the document it held is
tried again, up to :data:`MAX_ATTEMPTS` times in all; then it gets an error record. Workers that
cannot start (the model does not load there) end the run after :data:`MAX_ATTEMPTS` in a row. A document
that fails inside a live actor gets its error record as with the local engine. Ctrl-C or SIGTERM
of the driver stops it between two records (every written line is whole) and ends the actors.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass

from .batch import Job, ResultsFile, longest_first, plan, read_input, record, run_job
from .config import Settings
from .errors import IceCacheError, UsageError

MAX_ATTEMPTS = 3  # a document whose worker died this many times gets an error record
EXTRA = "pip install 'icecache[ray]'"


def check_ray(settings: Settings, gpus_per_worker: float) -> None:
    """Ray importable and the options consistent with the profile, before anything loads."""
    if gpus_per_worker > 0 and not settings.device.startswith("cuda"):
        raise UsageError(f"--gpus-per-worker needs a GPU profile (device cuda); this profile's device "
                         f"is {settings.device}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError(f"--engine ray needs Ray, an optional extra: {EXTRA}") from None


@dataclass
class RayOptions:
    address: str | None
    workers: int | None
    cpus_per_worker: int
    gpus_per_worker: float
    model: str | None
    settings: Settings
    method: str
    budget: int | None
    max_new_tokens: int


@dataclass
class Tally:
    failed: int = 0
    failed_before: int = 0
    skipped: int = 0
    done: int = 0


class Scheduler:
    """Which document goes to a free worker next (longest first), and what happens to one whose
    worker died: back to the front of the queue while it has attempts left, else an error."""

    def __init__(self, jobs: list[Job], max_attempts: int = MAX_ATTEMPTS):
        self.queue: deque[Job] = deque(longest_first(jobs))
        self.max_attempts = max_attempts
        self.running = 0

    def __bool__(self) -> bool:
        return bool(self.queue) or self.running > 0

    def next(self) -> Job | None:
        if not self.queue:
            return None
        self.running += 1
        return self.queue.popleft()

    def finished(self, job: Job) -> None:
        self.running -= 1

    def requeue(self, job: Job) -> None:
        """``job`` never started (its worker failed to start): first in the queue again."""
        self.running -= 1
        self.queue.appendleft(job)

    def died(self, job: Job) -> bool:
        """The worker running ``job`` died: True if it is queued again (first, as the longest
        left), False if it has had all its attempts."""
        self.running -= 1
        job.attempts += 1
        if job.attempts < self.max_attempts:
            self.queue.appendleft(job)
            return True
        return False


def error_records(job: Job, task: str, opts: RayOptions, error: str) -> list[dict]:
    """A document's records when no worker could give them (one per question, as run_job's)."""
    return [record(job.path, job.digest, task, q, opts.method, opts.budget, error) for q in job.questions]


class _Worker:
    """One actor: the model and the settings, loaded once; then documents one at a time."""

    def __init__(self, model: str | None, settings: Settings, method: str, threads: int):
        import torch

        from .models import load_model
        from .tasks import Runner

        torch.set_num_threads(max(1, threads))
        self.runner = Runner(load_model(model, settings), settings, method)

    def pid(self) -> int:
        return os.getpid()

    def run(self, job: Job, data: bytes | None, read_error: str | None, task: str,
            max_new_tokens: int, method: str, budget: int | None) -> list[dict]:
        return run_job(self.runner, job, data, read_error, task, max_new_tokens, method, budget)


def _pending_signal(arrived: list[int], handlers: dict) -> None:
    """Run the previous handler of a signal that arrived (the CLI's raises to unwind)."""
    if not arrived:
        return
    signum = arrived[0]
    handler = handlers[signum]
    signal.signal(signum, handler)
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)


def _last_line(exc: BaseException) -> str:
    lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
    return lines[-1] if lines else type(exc).__name__


def run_ray(inputs: list[str], task: str, questions: list[str | None], results: ResultsFile,
            opts: RayOptions, rep, quiet: bool) -> Tally:
    """Every pending document of ``inputs`` through the actor pool; records into ``results``."""

    import ray

    todo = plan(inputs, task, questions, results)
    tally = Tally(skipped=todo.skipped, failed_before=todo.failed_before)
    if not todo.jobs:
        results.close()
        return tally
    started_here = not ray.is_initialized()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    arrived: list[int] = []
    try:
        if started_here:
            ray.init(address=opts.address, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)
    except Exception as exc:  # a wrong address, a cluster that does not answer
        results.close()
        raise IceCacheError(f"--engine ray: cannot start or join Ray ({_last_line(exc)})") from None
    # A signal only notes itself while Ray's own code runs (an exception raised inside its Cython
    # calls comes out as a SystemError); the loop hands it to the previous handler between calls.
    for sig in handlers:
        signal.signal(sig, lambda signum, _frame: arrived.append(signum))
    inflight: dict = {}  # object ref -> (actor, job)
    idle: list = []
    try:
        return _drive(ray, todo, task, results, opts, rep, quiet, tally, arrived, handlers, inflight, idle)
    finally:  # Ctrl-C and SIGTERM: whole lines only (one write each), then the actors end
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        results.close()
        for actor in [a for a, _job in inflight.values()] + idle:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        if started_here:
            ray.shutdown()


def _drive(ray, todo, task, results, opts, rep, quiet, tally, arrived, handlers, inflight, idle) -> Tally:
    """The scheduling loop of :func:`run_ray` (which cleans up after it)."""
    import sys

    from ray.exceptions import RayActorError, RayTaskError

    actor_cls = ray.remote(_Worker).options(num_cpus=opts.cpus_per_worker, num_gpus=opts.gpus_per_worker,
                                            max_restarts=0, max_task_retries=0)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    size = opts.workers or max(1, cpus // opts.cpus_per_worker)
    size = min(size, len(todo.jobs))
    if not quiet:
        rep.info(f"ray: {len(todo.jobs)} documents over {size} workers ({opts.cpus_per_worker} CPU each, "
                 f"{cpus} CPUs in the cluster), longest first")

    def new_actor():
        return actor_cls.remote(opts.model, opts.settings, opts.method, opts.cpus_per_worker)

    sched = Scheduler(todo.jobs)
    idle.extend(new_actor() for _ in range(size))
    failed_starts = 0  # workers in a row whose model did not load
    t0 = time.perf_counter()

    def write(recs: list[dict]) -> None:
        for rec in recs:
            results.write(rec, sys.stdout)
            tally.failed += rec["error"] is not None

    while sched:
        _pending_signal(arrived, handlers)
        while idle and sched.queue:
            job = sched.next()
            data, digest, read_error = read_input(job.path)
            job.digest = digest if digest is not None else job.digest  # what is sent is recorded
            actor = idle.pop()
            ref = actor.run.remote(job, data, read_error, task, opts.max_new_tokens, opts.method,
                                   opts.budget)
            inflight[ref] = (actor, job)
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
        for ref in ready:
            actor, job = inflight.pop(ref)
            try:
                recs = ray.get(ref)
            except RayActorError as exc:  # the process died: a new actor, the job again
                idle.append(new_actor())
                if exc.actor_init_failed:  # the model did not load: not the document's fault
                    failed_starts += 1
                    if failed_starts >= MAX_ATTEMPTS:
                        raise IceCacheError(f"--engine ray: {failed_starts} workers in a row could not "
                                            f"start ({_last_line(exc)})") from None
                    sched.requeue(job)
                    continue
                if sched.died(job):
                    if not quiet:
                        rep.warn(f"ray: a worker died while processing {job.path}; trying it again "
                                 f"(attempt {job.attempts + 1} of {sched.max_attempts})")
                    continue
                recs = error_records(job, task, opts, f"{job.path}: the worker died {job.attempts} "
                                     f"times while processing it ({_last_line(exc)})")
            except RayTaskError as exc:  # an unexpected error inside a live actor
                sched.finished(job)
                idle.append(actor)
                recs = error_records(job, task, opts, f"{job.path}: {_last_line(exc)}")
            else:
                sched.finished(job)
                idle.append(actor)
                failed_starts = 0
            write(recs)
            tally.done += 1
            if not quiet:
                rate = tally.done / max(1e-9, time.perf_counter() - t0) * 60
                left = len(todo.jobs) - tally.done
                rep.info(f"[{tally.done}/{len(todo.jobs)}] {job.path}: "
                         f"{'failed' if recs[-1]['error'] else 'ok'}; {tally.failed} failed, "
                         f"{rate:.1f} documents/min, {left} left")
    _pending_signal(arrived, handlers)  # one that came with the last record
    return tally
