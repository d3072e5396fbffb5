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


def no_color() -> bool:
    """``NO_COLOR`` set (to anything but empty): no colours and no styles (https://no-color.org);
    the live panel may still move the cursor."""
    return bool(os.environ.get("NO_COLOR"))


def stderr_console(**kwargs) -> Console:
    """The console for stderr; without styles under ``NO_COLOR``."""
    return Console(stderr=True, highlight=False, **({"color_system": None} if no_color() else {}), **kwargs)


stderr = stderr_console()


def write_out(text: str) -> None:
    """Write (part of) a result to stdout now. A reader that went away ends the program quietly."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        raise typer.Exit(0) from None


def emit(text: str) -> None:
    """Write a result to stdout, ending its line."""
    write_out(text if text.endswith("\n") else text + "\n")


def silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def error(message: str) -> None:
    stderr.print(f"icecache: error: {message}", markup=False, soft_wrap=True)


def warn(message: str) -> None:
    stderr.print(f"icecache: warning: {message}", markup=False, soft_wrap=True)


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
        if not speed:
            return Text("")
        unit = "tok" if task.fields.get("unit", "tokens") == "tokens" else task.fields["unit"]
        return Text(rate_text(speed, unit), style="progress.data.speed")


def _unit(phase: str) -> str:
    """What a phase counts: tokens (prefill, decode, capture) or its own name (cells, ...)."""
    return "tokens" if phase in ("prefill", "decode", "capture") else phase


def rate_text(rate: float, unit: str) -> str:
    """``N unit/s``, or ``N unit/min`` below one a second (eval cells)."""
    return f"{rate:,.0f} {unit}/s" if rate >= 1 or rate == 0 else f"{60 * rate:,.1f} {unit}/min"


def panel_capable() -> bool:
    """A live display makes sense: stderr is a terminal that can move its cursor."""
    return stderr.is_terminal and not stderr.is_dumb_terminal


class Reporter:
    """Progress and status on stderr.

    On a terminal, a live bar per phase (tokens done / total, tokens per second, time left), or
    with ``panel`` (a title) the live panel of :mod:`icecache_cli.live`. On any other stderr (a
    log file, a pipeline, TERM=dumb), a plain line at most every ``every`` seconds.
    """

    every = 10.0

    def __init__(self, quiet: bool = False, panel: str | None = None, show_text: bool = False):
        self.quiet = quiet
        self.live = not quiet and panel_capable()
        self._progress: Progress | None = None
        self._tasks: dict[str, int] = {}
        self._plain: dict[str, tuple[float, int, float]] = {}  # phase -> (t0, done at t0, last line)
        self.panel = None
        self.memory_probe = None  # () -> dict of memory figures (icecache_cli.live.memory_now)
        self._mem_at = 0.0
        self._pages0: tuple[int, int] | None = None  # (pages loaded, steps) at the last token
        if self.live and panel:
            from .live import LivePanel

            self.panel = LivePanel(stderr, panel, show_text=show_text)
            self.panel.start()

    def phase(self, name: str) -> None:
        if self.panel is not None:
            self.panel.phase = name

    def _refresh_memory(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.panel is None or self.memory_probe is None or (not force and now - self._mem_at < 0.5):
            return
        self._mem_at = now
        try:
            self.panel.mem = self.memory_probe()
        except Exception:  # noqa: BLE001 - a display must never break the run
            pass

    def token(self, tokens: list[int], max_tokens: int, step_seconds: list[float], cache=None) -> None:
        self.step(len(tokens), max_tokens, step_seconds, cache)

    def step(self, done: int, total: int, step_seconds: list[float], cache=None) -> None:
        """A decode step happened (for the panel: count, latency, pages loaded, memory)."""
        if self.panel is None:
            return
        self.panel.decode(done, total, step_seconds)
        st = getattr(cache, "stats", None)
        if st is not None and hasattr(st, "pages_loaded"):
            now = (st.pages_loaded, st.steps)
            if self._pages0 is not None and now[1] > self._pages0[1]:
                self.panel.pages_per_step = (now[0] - self._pages0[0]) / (now[1] - self._pages0[1])
            self._pages0 = now
        self._refresh_memory()

    def info(self, message: str) -> None:
        if not self.quiet:
            stderr.print(message, style="dim", markup=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            warn(message)

    def progress(self, phase: str, done: int, total: int) -> None:
        if self.quiet:
            return
        if self.panel is not None:
            if phase == "prefill":
                self.panel.prefill(done, total)
                self._refresh_memory()
            return
        if not self.live:
            self._plain_line(phase, done, total)
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}"),
                RateColumn(),
                TimeRemainingColumn(),
                console=stderr,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._progress.start()
        if phase not in self._tasks:
            self._tasks[phase] = self._progress.add_task(phase, total=total, unit=_unit(phase))
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
        unit = _unit(phase)
        stderr.print(f"{phase}: {done}/{total} {unit}, {rate_text(rate, unit)}, about {eta:.0f} s left",
                     style="dim", markup=False, soft_wrap=True)

    def close(self) -> None:
        """End the progress bars (a table or result can follow); the panel stays."""
        self._plain.clear()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._tasks.clear()

    def finish(self) -> None:
        """Close, and leave the panel's last frame (with the final figures) on the terminal."""
        self.close()
        if self.panel is not None:
            self._refresh_memory(force=True)
            self.panel.phase = "done"
            self.panel.stop()
            self.panel = None

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self.panel is not None:
            self.panel.discard()  # a failed run leaves its error line alone, not a last frame
        self.finish()
