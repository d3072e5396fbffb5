"""The files of a resumable evaluation in ``--out``: ``results.jsonl`` (one row per finished
cell), ``cases.jsonl`` (one line per finished case, so that a killed run resumes mid-cell) and the
check that a rerun into the same folder was made with the same cases and settings
(``config.json``). Lines cut short by a kill are skipped: their cell or case runs again.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError

# What a finished cell's score depends on besides its own (task, method, budget, length, wording).
CASE_KEYS = ("n", "seed", "new_tokens", "data", "settings", "model", "depths", "wordings")


def check_resumable(out: Path, config: dict) -> None:
    """Refuse to resume into ``out`` when its results came from other cases or settings.

    Cells are keyed by (task, method, budget, length) only, so results made with another ``--n``,
    seed, data file, model or profile would otherwise be reused silently. Adding tasks, methods,
    budgets or lengths to a run is fine.
    """
    cfg_path, res_path = out / "config.json", out / "results.jsonl"
    if not (cfg_path.exists() and res_path.exists() and res_path.stat().st_size):
        return
    try:
        old = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError):
        raise UsageError(f"--out: {cfg_path} is unreadable; use another --out") from None
    new = json.loads(json.dumps(config))  # the same JSON types as the file
    for key in CASE_KEYS:
        a, b = old.get(key), new.get(key)
        if key == "settings" and isinstance(a, dict) and isinstance(b, dict):
            # The budget is part of each cell; settings added by a later version (absent from
            # an older run's file) take their defaults and are not compared.
            diff = sorted(k for k in set(a) & set(b) if k != "budget" and a[k] != b[k])
            if diff:
                raise UsageError(f"--out: {out} holds results made with other settings "
                                 f"({', '.join(diff)}); use another --out to keep both")
        elif key == "wordings":
            # a wording's label names its template: the same label must mean the same words
            diff = sorted(k for k in set(a or {}) & set(b or {}) if a[k] != b[k])
            if diff:
                raise UsageError(f"--out: {out} holds results of other wordings named {', '.join(diff)}; "
                                 "use other names or another --out")
        elif a != b:
            raise UsageError(f"--out: {out} holds results made with {key} {a!r}, not {b!r}; "
                             "use another --out to keep both")


def load_done(out: Path | None) -> dict[tuple, dict]:
    done = {}
    if out and (out / "results.jsonl").exists():
        for line in (out / "results.jsonl").read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill: that cell runs again
            done[(r["task"], r["method"], r["budget"], r["length"], r.get("prompt", ""))] = r
    return done


def load_cases(out: Path | None) -> dict[tuple, float]:
    """(cell key, case index) -> score of the cases an earlier run into ``out`` finished (a cell's
    row is written only when all its cases are done; these let a killed run resume mid-cell)."""
    done: dict[tuple, float] = {}
    path = None if out is None else out / "cases.jsonl"
    if path is None or not path.exists():
        return done
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
            cell = tuple(r["cell"])
            done[(cell + ("",) * (5 - len(cell)), int(r["case"]))] = float(r["score"])  # (older rows: no wording)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a line cut by a kill: that case runs again
    return done


# a case's answer as kept in cases.jsonl: enough to see what the model said, not a transcript
OUTPUT_CHARS = 200


def append_case(out: Path | None, key: tuple, case: int, score: float, output: str | None = None,
                expected: list[str] | None = None) -> None:
    """One finished case in ``out``/cases.jsonl: its cell, index and score, and (generated
    tasks) the start of the answer and what it was scored against, to see why a case failed."""
    if out is None:
        return
    row = {"cell": list(key), "case": case, "score": score}
    if output is not None:
        row["output"] = output[:OUTPUT_CHARS]
    if expected is not None:
        row["expected"] = expected
    with open(out / "cases.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def append(out: Path | None, row: dict) -> None:
    if out is None:
        return
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
