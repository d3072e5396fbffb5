"""numba's cache folder follows the kernels' sources (icecache/numba_cache.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from icecache import numba_cache


def test_every_kernel_module_is_listed_and_sets_the_folder_first():
    """Each icecache file that imports numba is in KERNEL_FILES and imports numba_cache."""
    found = set()
    for path in numba_cache.PACKAGE.rglob("*.py"):
        text = path.read_text()
        if "from numba import" in text or "import numba\n" in text:
            rel = path.relative_to(numba_cache.PACKAGE).as_posix()
            if rel != "numba_cache.py":
                found.add(rel)
                assert "import numba_cache" in text, rel
    assert found == set(numba_cache.KERNEL_FILES)


def test_the_folder_changes_with_any_kernel_file(tmp_path):
    for name in numba_cache.KERNEL_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(numba_cache.PACKAGE / name, tmp_path / name)
    same = numba_cache.digest(tmp_path)
    assert same == numba_cache.digest()
    for name in numba_cache.KERNEL_FILES:
        before = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(before + b"# edited\n")
        assert numba_cache.digest(tmp_path) != same, name
        (tmp_path / name).write_bytes(before)
    assert numba_cache.digest(tmp_path) == same


def test_numba_uses_the_folder_unless_told_otherwise(tmp_path):
    code = "import numba, icecache.index.kernels, icecache.cache.kernels; print(numba.config.CACHE_DIR)"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["ICECACHE_CACHE_DIR"] = str(tmp_path / "c")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(tmp_path / "c" / "numba" / numba_cache.digest())
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(tmp_path / "mine")


def test_the_makefile_warms_up_again_when_any_kernel_file_changes():
    """`make`'s warm-up stamp depends on every kernel file (a stale stamp let two test workers
    compile the same kernels at once)."""
    import re

    text = (numba_cache.PACKAGE.parent / "Makefile").read_text()
    block = re.search(r"^KERNELS = (.*?)(?<!\\)\n", text, re.S | re.M).group(1)
    named = block.split()
    for name in numba_cache.KERNEL_FILES:
        path = f"icecache/{name}"
        globbed = f"{path.rsplit('/', 1)[0]}/*.py)"  # the tail of a $(wildcard ...)
        assert path in named or globbed in named, name
