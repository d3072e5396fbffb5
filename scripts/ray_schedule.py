"""Wall time of ``icecache batch`` over a folder of very unequal documents on 2 CPUs: the Ray
engine (2 workers of 1 CPU, longest first) against static 2-way splits run as two local
processes of 1 thread each: the ``--shard`` hash split; the split a user can plan from the
files alone (longest first by size, each to the lighter side); and the best split of the
documents (the partition that balances the per-document seconds measured in the hash-split
run). The best static split is the fastest of the three, measured.

    python scripts/ray_schedule.py [--docs 12] [--scale 1.0] [--max-new-tokens 32] [--keep DIR]

``--scale`` multiplies every document's length (more work per worker: Ray's fixed start and
stop cost weighs less).

Needs the ray extra. The document cache is off (a later run would load the first's prefills).
Prints one table; every figure is from this run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FACT = "Entry {k} of report {i}: the ferry number {k} left the harbor at {h} o'clock with {p} passengers."


def make_folder(root: Path, docs: int, scale: float = 1.0) -> list[Path]:
    """One long document (about 5k tokens x ``scale``), a few of middle size, many short."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = [max(1, round(n * scale)) for n in [230] + [40, 30, 20] + [4] * max(0, docs - 4)]
    paths = []
    for i, entries in enumerate(sizes[:docs]):
        p = root / f"report{i:02d}.txt"
        p.write_text(" ".join(FACT.format(k=k, i=i, h=6 + k % 12, p=10 * k + i) for k in range(entries)) + "\n")
        paths.append(p)
    return paths


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "icecache_cli", "batch", *args]


def run_pair(cmds: list[tuple[list[str], bytes | None]]) -> float:
    """Start the commands together; the wall time until the last ends."""
    t0 = time.perf_counter()
    procs = []
    for cmd, stdin in cmds:
        p = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        p.stdin.write(stdin or b"")
        p.stdin.close()
        procs.append(p)
    for p in procs:
        err = p.stderr.read()
        if p.wait() not in (0, 3):
            raise SystemExit(f"failed: {' '.join(p.args)}\n{err.decode()}")
    return time.perf_counter() - t0


def best_split(seconds: dict[str, float]) -> tuple[list[str], list[str], float]:
    """The 2-way partition of the documents with the smallest larger side (exhaustive)."""
    names = sorted(seconds)
    best = (names, [], float("inf"))
    for mask in itertools.product([0, 1], repeat=len(names) - 1):
        a = [names[0]] + [n for n, m in zip(names[1:], mask, strict=True) if m == 0]
        b = [n for n, m in zip(names[1:], mask, strict=True) if m == 1]
        worst = max(sum(seconds[n] for n in a), sum(seconds[n] for n in b))
        if worst < best[2]:
            best = (a, b, worst)
    return best


def size_split(paths: list[Path]) -> tuple[list[str], list[str]]:
    """Longest first by file size, each document to the side with fewer bytes so far."""
    sides: tuple[list[str], list[str]] = ([], [])
    load = [0, 0]
    for p in sorted(paths, key=lambda p: p.stat().st_size, reverse=True):
        i = 0 if load[0] <= load[1] else 1
        sides[i].append(str(p))
        load[i] += p.stat().st_size
    return sides


def main() -> None:
    os.environ["ICECACHE_DOC_CACHE"] = "off"  # every run computes its prefills (the Ray workers inherit it)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--keep", type=Path, help="folder for the documents and outputs (default: a temporary one)")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="ray-schedule-"))
    docs = make_folder(root / "docs", args.docs, args.scale)
    profile = root / "cpu1.yaml"
    profile.write_text((REPO / "profiles" / "cpu.yaml").read_text().replace("cpu_threads: 0", "cpu_threads: 1"))
    common = ["--max-new-tokens", str(args.max_new_tokens), "--profile", str(profile), "--quiet"]
    folder = str(root / "docs")

    outs = {k: root / f"{k}.jsonl" for k in ("hash0", "hash1", "size0", "size1", "best0", "best1", "ray")}
    for p in outs.values():
        p.unlink(missing_ok=True)
    t_hash = run_pair([(cli(folder, "--shard", f"{i}/2", "--out", str(outs[f"hash{i}"]), *common), None)
                       for i in range(2)])
    seconds = {}
    for k in ("hash0", "hash1"):
        for line in outs[k].read_text().splitlines():
            r = json.loads(line)
            seconds[r["path"]] = r["seconds"]
    sa, sb = size_split(docs)
    t_size = run_pair([(cli("-", "--out", str(outs[f"size{i}"]), *common), ("\n".join(part) + "\n").encode())
                       for i, part in enumerate((sa, sb))])
    a, b, predicted = best_split(seconds)
    t_best = run_pair([(cli("-", "--out", str(outs[f"best{i}"]), *common), ("\n".join(part) + "\n").encode())
                       for i, part in enumerate((a, b))])
    t_ray = run_pair([(cli(folder, "--engine", "ray", "--workers", "2", "--cpus-per-worker", "1",
                           "--out", str(outs["ray"]), *common), None)])
    lines = sum(len(p.read_text().splitlines()) for p in (outs["ray"],))
    total = sum(seconds.values())
    print(f"{len(docs)} documents, per-document seconds {min(seconds.values()):.1f} .. "
          f"{max(seconds.values()):.1f}, {total:.1f} s in all (hash-split run); ray wrote {lines} records")
    best_static = min(t_hash, t_size, t_best)
    print("| schedule | wall s | vs best static |")
    print("|---|---|---|")
    for name, t in (("static, --shard hash split (2 processes)", t_hash),
                    (f"static, by file size, longest first ({len(sa)} + {len(sb)} documents)", t_size),
                    (f"static, split by the measured seconds ({len(a)} + {len(b)} documents; larger side "
                     f"{predicted:.1f} s of work)", t_best),
                    ("ray, 2 workers x 1 CPU, longest first", t_ray)):
        print(f"| {name} | {t:.1f} | {t / best_static:.2f} |")


if __name__ == "__main__":
    main()
