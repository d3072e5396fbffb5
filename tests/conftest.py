"""Shared fixtures: the embedded model loaded once, and a runner for the real CLI process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "harbor-report.txt"


@pytest.fixture(scope="session")
def cpu_settings():
    from icecache.config import resolve_settings

    return resolve_settings("cpu")


@pytest.fixture(scope="session")
def loaded(cpu_settings):
    """The embedded model (converted once into the user cache, as a user's first run does)."""
    from icecache.models import load_model

    return load_model(None, cpu_settings)


def run_cli(args: list[str], stdin: bytes | None = b"", env: dict | None = None, timeout: int = 300):
    """Run ``python -m icecache_cli ARGS`` as a real process; return the CompletedProcess."""
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "icecache_cli", *args],
        input=stdin,
        capture_output=True,
        env=full_env,
        cwd=REPO,
        timeout=timeout,
    )
