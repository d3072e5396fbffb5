"""Locally generated evaluation tasks (no downloads) and their scorers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..errors import InputError


def read_jsonl(path: str | Path, parse: Callable[[dict], dict], fields: str) -> list[dict]:
    """Rows of a JSONL ``--data`` file, each through ``parse``; one clear error for a bad line.

    ``fields`` names what a row must hold, for that error. Blank lines are skipped.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--data: no such file: {p}")
    rows = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(parse(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"--data: {p}: line {i} is not a JSON object with {fields}") from None
    return rows
