"""Batch processing of many documents: input listing, sharding, resumable JSONL output.

- Inputs: files, folders (searched recursively with a glob) and path lists read from stdin.
- Sharding: ``--shard I/N`` keeps the inputs whose path hashes to ``I`` modulo ``N`` (sha256 of
  the path as given), so N machines given the same inputs split them disjointly, each document
  exactly once, whatever order they list them in.
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
from collections.abc import Iterable
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
