"""Where numba keeps icecache's compiled kernels: one folder per version of the kernels' sources.

numba's on-disk cache (``cache=True``) checks each function against its own file only. A kernel
that calls a kernel of another file keeps its cached machine code when only the callee's file
changed (an upgrade, an edit), so it would go on running the old callee. Every kernel module
imports this module before it defines a kernel: numba's cache then lives in a folder named by a
digest of all the kernel files and numba's version, and any change to any of them compiles
afresh (``python -m icecache.warmup``, which ``make setup`` runs, fills the new folder).

``NUMBA_CACHE_DIR``, when set, is left alone.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

PACKAGE = Path(__file__).resolve().parent
# Every icecache module that compiles numba kernels (tests/test_numba_cache.py keeps this whole).
KERNEL_FILES = (
    "cache/kernels.py",
    "cache/score_kernels.py",
    "fused_step.py",
    "index/kernels/build.py",
    "index/kernels/pairs.py",
    "index/kernels/pages.py",
    "index/kernels/query.py",
    "index/kernels/refine.py",
    "index/kernels/shared.py",
    "int16_inputs.py",
    "int8_rows.py",
    "prefetch.py",
)


def digest(root: Path = PACKAGE) -> str:
    """A short digest of the kernel files under ``root`` and numba's version."""
    h = hashlib.sha256(numba.__version__.encode())
    for name in KERNEL_FILES:
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def folder() -> Path:
    """The numba cache folder of this version of the kernels, in icecache's user cache."""
    from .models import cache_root

    return cache_root() / "numba" / digest()


def configure() -> None:
    """Point numba's cache at :func:`folder` (unless ``NUMBA_CACHE_DIR`` is set)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    numba.config.CACHE_DIR = str(folder())


configure()
