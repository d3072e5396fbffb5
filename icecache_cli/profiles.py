"""``icecache profiles``: list the hardware profiles, or check and show given ones."""

from __future__ import annotations

import io
import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from icecache.config import load_profile, shipped_profiles

from .output import emit, user_errors

COLUMNS = ("device", "device_memory_gib", "host_memory_gib", "cpu_threads", "dtype", "page_size",
           "budget", "sink_pages", "window_pages", "dense_layers", "chunk_size", "max_context")


def profiles(
    names: Annotated[list[str] | None, typer.Argument(metavar="[NAME|PATH]...", help="Profiles to check and show (default: all shipped).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List hardware profiles with their key values (validating each one)."""
    with user_errors():
        loaded = [load_profile(n) for n in (names or list(shipped_profiles()))]
    if as_json:
        emit(json.dumps([s.as_dict() for s in loaded]))
        return
    table = Table("name", *COLUMNS, title=None, box=None, pad_edge=False)
    for s in loaded:
        table.add_row(s.name, *(str(getattr(s, c)) for c in COLUMNS))
    buf = io.StringIO()
    Console(file=buf, width=200, no_color=True).print(table)
    emit(buf.getvalue())
