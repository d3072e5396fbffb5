"""The paper's needle picture as data: accuracy per (length, depth) for each task, method, budget.

Cells of the needle tasks record each case's depth (``depths``) beside its score (``detail``);
:func:`depth_grids` folds the finished cells into one grid per (task, method, budget): a column per
length, a row per depth, each entry the mean score of the cases there (None where none ran).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    task: str
    method: str
    budget: int
    lengths: list[int]
    depths: list[float]
    cells: list[list[float | None]]  # [depth row][length column]
    counts: list[list[int]]
    prompt: str = ""  # the prompt suite's wording ("": the shipped one)

    @property
    def title(self) -> str:
        return (f"{self.task} · {self.method}" + (f" @ {self.budget}" if self.budget else "")
                + (f" · {self.prompt}" if self.prompt else ""))

    @property
    def overall(self) -> float:
        """The mean over every case in the grid (each case counted once)."""
        total = sum(c * v for row_c, row_v in zip(self.counts, self.cells, strict=True)
                    for c, v in zip(row_c, row_v, strict=True) if v is not None)
        n = sum(sum(row) for row in self.counts)
        return total / n if n else 0.0


def depth_grids(rows: list[dict]) -> list[Grid]:
    """One :class:`Grid` per (task, method, budget, wording) among ``rows`` whose cases carry depths."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if "depths" not in r or "detail" not in r:
            continue
        groups.setdefault((r["task"], r["method"], r["budget"], r.get("prompt", "")), {})[r["length"]] = r
    grids = []
    for (task, method, budget, prompt), by_length in groups.items():
        lengths = sorted(by_length)
        depths = sorted({d for r in by_length.values() for d in r["depths"]})
        sums = [[0.0] * len(lengths) for _ in depths]
        counts = [[0] * len(lengths) for _ in depths]
        for j, length in enumerate(lengths):
            r = by_length[length]
            for d, s in zip(r["depths"], r["detail"], strict=True):
                i = depths.index(d)
                sums[i][j] += s
                counts[i][j] += 1
        cells = [[s / c if c else None for s, c in zip(srow, crow, strict=True)] for srow, crow in zip(sums, counts, strict=True)]
        grids.append(Grid(task, method, budget, lengths, depths, cells, counts, prompt))
    return grids
