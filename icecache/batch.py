"""Batch processing of many documents: input listing, sharding, resumable JSONL output.

- Inputs: files, folders (searched recursively with a glob) and path lists read from stdin.
- Sharding: ``--shard I/N`` keeps the inputs whose path hashes to ``I`` modulo ``N`` (sha256 of
  the path as given), so N machines given the same inputs split them disjointly, each document
  exactly once, whatever order they list them in.
- Jobs: a document's questions still to do (:func:`plan`, the resume filter both engines use),
  run by :func:`run_job` wherever the model is: in this process (the local engine) or in a Ray
  actor (:mod:`icecache.batch_ray`, documents longest first: :func:`longest_first`).
- Output: one JSON object per document (per question for ``qa``) and line, written in one call
  and flushed. A rerun with the same output file skips the (resolved path, content hash, task,
  question) records already there, however the path is spelled (relative or absolute); a line
  cut by a hard kill is dropped when the file is reopened. Error records count as done (a bad
  document stays bad) but keep the rerun's exit code at 3.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

EXIT_SOME_FAILED = 3  # some documents failed; their error records are in the output


def parse_shard(text: str | None) -> tuple[int, int]:
    if text is None:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard: '{text}' is not I/N (for example 0/4)") from None
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard: '{text}' needs 0 <= I < N")
    return i, n


def in_shard(path: str, shard: tuple[int, int]) -> bool:
    i, n = shard
    return n == 1 or int(hashlib.sha256(path.encode()).hexdigest(), 16) % n == i


def list_inputs(paths: Iterable[str], glob: str, stdin_lines: Iterable[str] | None = None) -> list[str]:
    """Expand PATHs (files, folders, ``-`` = paths from stdin) into a sorted list of file paths,
    each file once however it is spelled.

    A missing path is kept: it becomes an error record, like any other unreadable document. No
    file at all (folders where nothing matches ``glob``, an empty list on stdin) is a usage error.
    """
    out: list[str] = []
    empty: list[str] = []
    for p in paths:
        if p == "-":
            if stdin_lines is None:
                raise UsageError("'-' given but stdin is closed")
            listed = [line.strip() for line in stdin_lines if line.strip()]
            out.extend(listed)
            if not listed:
                empty.append("the list on stdin")
            continue
        path = Path(p)
        if path.is_dir():
            found = [str(f) for f in sorted(path.rglob(glob)) if f.is_file()]
            out.extend(found)
            if not found:
                empty.append(p)
        else:
            out.append(p)
    if not out:
        raise UsageError(f"no input files: nothing matches --glob '{glob}' in {', '.join(empty)}"
                         if any(e != "the list on stdin" for e in empty) else "no input files: the list on stdin is empty")
    seen, unique = set(), []
    for p in out:
        if resolved(p) not in seen:
            seen.add(resolved(p))
            unique.append(p)
    return unique


def resolved(path: str) -> str:
    """The absolute path with links resolved: one document's one name, however it is spelled."""
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError):
        return os.path.abspath(path)


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def record_key(rec: dict) -> tuple:
    return (resolved(str(rec.get("path"))), rec.get("hash"), rec.get("task"), rec.get("question"))


class ResultsFile:
    """Append-only JSONL results; knows which records are already done (``done``: record keys)
    and which of those have only error records (``failed``)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.done: set[tuple] = set()
        self.failed: set[tuple] = set()
        ok: set[tuple] = set()
        self._fd: int | None = None
        if path is None:
            return
        if path.is_dir():
            raise UsageError(f"--out: {path} is a folder; give a file name for the JSONL results")
        if path.exists():
            data = path.read_bytes()
            keep = data[: data.rfind(b"\n") + 1]  # drop a last line cut by a hard kill
            if len(keep) != len(data):
                with open(path, "r+b") as f:
                    f.truncate(len(keep))
            for line in keep.decode("utf-8", "replace").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(rec, dict):
                    continue
                key = record_key(rec)
                self.done.add(key)  # error records too: a bad document stays bad
                if rec.get("error") is None:
                    ok.add(key)
        self.failed = self.done - ok
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UsageError(f"--out: {path} cannot be written ({exc.strerror or exc})") from None

    def write(self, rec: dict, stdout) -> None:
        line = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        if self._fd is not None:
            os.write(self._fd, line)  # one write: a line is there whole or not at all
        else:
            stdout.buffer.write(line)
            stdout.flush()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_input(path: str) -> tuple[bytes | None, str | None, str | None]:
    """A document's bytes, their content hash, and the error that replaces both when it cannot
    be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return None, None, f"{path}: cannot be read ({exc.strerror or exc})"
    return data, content_hash(data), None


@dataclass
class Job:
    """One document's work: the questions (``None`` for summarize and cot) not yet in the output.
    ``size``: its bytes (the longest-first key); ``digest``: its content hash when planned."""

    path: str
    digest: str | None
    questions: list[str | None]
    size: int = 0
    attempts: int = 0  # workers that died while running it (the Ray engine)


@dataclass
class Plan:
    jobs: list[Job] = field(default_factory=list)
    skipped: int = 0  # documents whose every record is in the output already
    failed_before: int = 0  # of those, the ones with an error record


def pending(results: ResultsFile, path: str, digest: str | None, task: str,
            questions: list[str | None]) -> list[str | None]:
    """The resume filter: ``questions`` of this document (path, content) not yet in ``results``."""
    return [q for q in questions if (resolved(path), digest, task, q) not in results.done]


def only_errors(results: ResultsFile, path: str, digest: str | None, task: str,
                questions: list[str | None]) -> bool:
    """Whether a document that is done has an error record without a good one (exit code 3)."""
    return any((resolved(path), digest, task, q) in results.failed for q in questions)


def record(path: str, digest: str | None, task: str, question: str | None, method: str,
           budget: int | None, error: str | None = None) -> dict:
    """A result record before its output is filled in (the fields every line has)."""
    return {"path": path, "hash": digest, "task": task, "question": question, "output": None,
            "tokens_in": 0, "tokens_out": 0, "seconds": 0.0, "method": method, "budget": budget,
            "error": error}


def plan(inputs: list[str], task: str, questions: list[str | None], results: ResultsFile) -> Plan:
    """Every input read once (for its content hash; the bytes are not kept): the jobs left to
    do, in input order, and what the output holds already."""
    out = Plan()
    for path in inputs:
        data, digest, _error = read_input(path)
        todo = pending(results, path, digest, task, questions)
        if not todo:
            out.skipped += 1
            out.failed_before += only_errors(results, path, digest, task, questions)
            continue
        out.jobs.append(Job(path, digest, todo, size=0 if data is None else len(data)))
    return out


def longest_first(jobs: list[Job]) -> list[Job]:
    """Largest documents first (ties in input order): a pool of workers that takes the next job
    as it frees ends with the short ones, not with one long document on one worker."""
    return sorted(jobs, key=lambda j: -j.size)


def run_job(runner, job: Job, data: bytes | None, read_error: str | None, task: str,
            max_new_tokens: int, method: str, budget: int | None, emit=None) -> list[dict]:
    """One document's records (one per question), each with ``error`` set instead of raising
    for a document that cannot be processed (unreadable, binary, empty, too long); ``emit``
    gets each record as soon as it is made."""
    from .documents import decode_text
    from .errors import IceCacheError

    recs = []
    for q in job.questions:
        rec = record(job.path, job.digest, task, q, method, budget)
        t0 = time.perf_counter()
        try:
            if data is None:
                raise IceCacheError(read_error or f"{job.path}: cannot be read")
            text = decode_text(data, job.path)
            if task == "summarize":
                r = runner.summarize(text, max_new_tokens)
            elif task == "cot":
                r = runner.cot(text, max_new_tokens)
            else:
                r = runner.qa(text, [q], max_new_tokens)
            rec.update(output=r.output[0] if task == "qa" else r.output,
                       tokens_in=r.tokens_in, tokens_out=r.tokens_out)
            if task == "cot":
                rec["answer"] = r.answer
        except IceCacheError as exc:
            rec["error"] = str(exc)
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        recs.append(rec)
        if emit is not None:
            emit(rec)
    return recs
