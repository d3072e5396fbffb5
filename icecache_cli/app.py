"""The Typer application and the ``icecache`` entry point.

``main`` owns process-level behaviour: exit codes (0 ok, 1 runtime failure, 2 usage error, 3 some
batch documents failed, 130 on Ctrl-C, 143 on SIGTERM), one-line errors instead of tracebacks
(the parser's too), and a quiet exit when stdout is closed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys

import typer

from icecache import __version__

from . import batch, bench, doccache, evaluate, profiles, tasks
from .options import method_lines
from .output import error, silence_stdout

app = typer.Typer(
    name="icecache",
    help="Long documents through local LLMs with the IceCache KV cache.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
for command in (tasks.summarize, tasks.qa, tasks.cot):
    app.command(epilog=method_lines())(command)
app.command()(profiles.profiles)
app.command("eval")(evaluate.evaluate)
app.command()(batch.batch)
app.command()(doccache.prefill)
app.add_typer(doccache.cache_app, name="cache")
app.add_typer(bench.bench_app, name="bench")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"icecache {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """Long documents through local LLMs with the IceCache KV cache."""


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived: unwind (files closed, no partial line written), then one line
    and the signal's exit code. Not a KeyboardInterrupt, which typer would turn into a silent
    exit code."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.word, self.code = ("interrupted", 130) if signum == signal.SIGINT else ("terminated", 143)


_stop_signal: list[int] = []  # the SIGINT or SIGTERM that arrived while the command ran


def _on_signal(signum, frame):
    _stop_signal.append(signum)
    raise Stopped(signum)


_late_signal: list[int] = []  # a signal that came while the interpreter was shutting down


def _note_late_signal(signum, frame) -> None:
    _late_signal.append(130 if signum == signal.SIGINT else 143)


@atexit.register  # registered first, so it runs after every other atexit callback (torch's too)
def _late_signal_exit() -> None:
    """A Ctrl-C or SIGTERM during shutdown ends the process with its exit code, not a traceback."""
    if _late_signal:
        with contextlib.suppress(Exception):
            what = "interrupted" if _late_signal[0] == 130 else "terminated"
            sys.stderr.write(f"icecache: error: {what}\n")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(_late_signal[0])


def usage_line(exc: Exception) -> str:
    """A parser error in one line (the parser's own text spans several, with its usage)."""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    return " ".join(message.split())


def _run(argv: list[str] | None) -> int:
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Exit as exc:
        code = exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        error("interrupted")
        code = 130
    except Stopped as exc:
        error(exc.word)
        code = exc.code
    except BrokenPipeError:
        silence_stdout()
        code = 0
    except typer.TyperException as exc:  # usage errors from the parser (typer's own click)
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare command: its help
            exc.show()
        else:
            error(usage_line(exc))
        code = getattr(exc, "exit_code", 2)
    except Exception as exc:  # a bug: one line, the traceback only on request
        if os.environ.get("ICECACHE_DEBUG"):
            raise
        if _stop_signal:  # raised while unwinding from the signal (a lock half released by it)
            stopped = Stopped(_stop_signal[0])
            error(stopped.word)
            return stopped.code
        error(f"internal error: {exc.__class__.__name__}: {exc} (set ICECACHE_DEBUG=1 for the traceback)")
        code = 1
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        code = _run(argv)
    except Stopped as exc:  # after the command, before the exit
        error(exc.word)
        code = exc.code
    # From here on the interpreter shuts down (threads joined, atexit callbacks): a signal now
    # must not print a traceback from whatever callback it lands in.
    signal.signal(signal.SIGINT, _note_late_signal)
    signal.signal(signal.SIGTERM, _note_late_signal)
    sys.exit(code)


if __name__ == "__main__":
    main()
