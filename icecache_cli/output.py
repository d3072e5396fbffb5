"""Where things are printed: results on stdout, everything else on stderr.

``emit`` writes results and turns a closed pipe (``| head``) into a quiet exit. ``Reporter`` shows
model loading, live progress (only on a terminal) and a one-line timing summary on stderr, all
silenced by ``--quiet``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from icecache.errors import IceCacheError

stderr = Console(stderr=True, highlight=False)


def emit(text: str) -> None:
    """Write a result to stdout. A reader that went away ends the program quietly."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        raise typer.Exit(0) from None


def silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def error(message: str) -> None:
    stderr.print(f"icecache: error: {message}", markup=False, soft_wrap=True)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn :class:`IceCacheError` into one line on stderr and its exit code."""
    try:
        yield
    except IceCacheError as exc:
        error(str(exc))
        raise typer.Exit(exc.exit_code) from None


class RateColumn(ProgressColumn):
    """Tokens per second of a task, once rich has measured a speed."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} tok/s" if speed else "", style="progress.data.speed")


class Reporter:
    """Progress and status on stderr.

    On a terminal, a live bar per phase (tokens done / total, tokens per second, time left). On
    any other stderr (a log file, a pipeline), a plain line at most every ``every`` seconds.
    """

    every = 10.0

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.live = not quiet and stderr.is_terminal
        self._progress: Progress | None = None
        self._tasks: dict[str, int] = {}
        self._plain: dict[str, tuple[float, int, float]] = {}  # phase -> (t0, done at t0, last line)

    def info(self, message: str) -> None:
        if not self.quiet:
            stderr.print(message, style="dim", markup=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            stderr.print(f"icecache: warning: {message}", markup=False, soft_wrap=True)

    def progress(self, phase: str, done: int, total: int) -> None:
        if self.quiet:
            return
        if not self.live:
            self._plain_line(phase, done, total)
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("tokens"),
                RateColumn(),
                TimeRemainingColumn(),
                console=stderr,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._progress.start()
        if phase not in self._tasks:
            self._tasks[phase] = self._progress.add_task(phase, total=total)
        self._progress.update(self._tasks[phase], completed=done, total=total)

    def _plain_line(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase not in self._plain or done < self._plain[phase][1]:  # a new run of the phase
            self._plain[phase] = (now, done, now)
            return
        started, done0, last = self._plain[phase]
        if now - last < self.every:
            return
        self._plain[phase] = (started, done0, now)
        rate = (done - done0) / max(now - started, 1e-9)
        eta = (total - done) / rate if rate > 0 else 0.0
        stderr.print(f"{phase}: {done}/{total} tokens, {rate:,.0f} tokens/s, about {eta:.0f} s left",
                     style="dim", markup=False, soft_wrap=True)

    def close(self) -> None:
        self._plain.clear()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._tasks.clear()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
