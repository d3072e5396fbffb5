"""The Typer application and the ``icecache`` entry point.

``main`` owns process-level behaviour: exit codes (0 ok, 1 runtime failure, 2 usage error, 130 on
Ctrl-C), one-line errors instead of tracebacks, and a quiet exit when stdout is closed.
"""

from __future__ import annotations

import os
import sys

import typer

from icecache import __version__

from . import batch, bench, evaluate, profiles, tasks
from .output import error, silence_stdout

app = typer.Typer(
    name="icecache",
    help="Long documents through local LLMs with the IceCache KV cache.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command()(tasks.summarize)
app.command()(tasks.qa)
app.command()(tasks.cot)
app.command()(profiles.profiles)
app.command("eval")(evaluate.evaluate)
app.command()(batch.batch)
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


def main(argv: list[str] | None = None) -> None:
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Exit as exc:
        code = exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        error("interrupted")
        code = 130
    except BrokenPipeError:
        silence_stdout()
        code = 0
    except typer.TyperException as exc:  # usage errors from the parser (typer's own click)
        exc.show()
        code = getattr(exc, "exit_code", 2)
    except Exception as exc:  # a bug: one line, the traceback only on request
        if os.environ.get("ICECACHE_DEBUG"):
            raise
        error(f"internal error: {exc.__class__.__name__}: {exc} (set ICECACHE_DEBUG=1 for the traceback)")
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
