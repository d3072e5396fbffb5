"""The needle picture (length x depth, colour = accuracy): in the terminal with rich, as a PNG with
matplotlib (the optional ``plot`` extra)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rich.columns import Columns
from rich.table import Table
from rich.text import Text

from icecache.errors import UsageError
from icecache.evals.grid import Grid

from .output import stderr


def length_text(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def colour(score: float) -> str:
    """Red (0) through yellow (0.5) to green (1), as an ``rgb(r,g,b)`` style."""
    s = min(1.0, max(0.0, score))
    r = 220 if s < 0.5 else int(220 - (s - 0.5) * 2 * 180)
    g = int(60 + s * 2 * 140) if s < 0.5 else 200
    return f"rgb({r},{g},60)"


def grid_table(grid: Grid) -> Table:
    title = f"{grid.title}  (mean {grid.overall:.2f})"
    t = Table(title=Text(title, style="table.title"), box=None, padding=(0, 0), show_edge=False, collapse_padding=True,
              min_width=len(title))
    t.add_column("depth", justify="right", style="dim")
    for length in grid.lengths:
        t.add_column(f" {length_text(length):>4}", justify="center")
    for depth, row in zip(grid.depths, grid.cells, strict=True):
        cells = []
        for v in row:
            if v is None:
                cells.append(Text("  ·  "))
            else:
                cells.append(Text(f" {round(100 * v):>3} ", style=f"black on {colour(v)}"))
        t.add_row(f"{round(100 * depth)}% ", *cells)
    return t


def print_grids(grids: list[Grid]) -> None:
    """Each grid as a coloured table on stderr, side by side where the terminal is wide enough."""
    if grids:
        stderr.print(Columns([grid_table(g) for g in grids], padding=(1, 3)))


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'icecache[plot]'") from None


def write_plot(grids: list[Grid], path: Path) -> None:
    """The grids as heatmaps in one PNG (written whole, then renamed into place)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not grids:
        raise UsageError("--plot: no finished cell of a needle task (passkey, niah_single, niah_prose) to draw")
    cols = min(3, len(grids))
    rows = (len(grids) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1, 3.4 * rows), squeeze=False)
    image = None
    for k, (ax, g) in enumerate(zip(axes.flat, grids, strict=False)):
        data = [[float("nan") if v is None else v for v in row] for row in g.cells]
        image = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"{g.title}\nmean {g.overall:.2f}", fontsize=9)
        ax.set_xticks(range(len(g.lengths)), [length_text(x) for x in g.lengths], fontsize=8)
        step = max(1, len(g.depths) // 10)
        ticks = list(range(0, len(g.depths), step))
        ax.set_yticks(ticks, [f"{round(100 * g.depths[i])}%" for i in ticks], fontsize=8)
        ax.set_xlabel("context length (tokens)", fontsize=8)
        if k % cols == 0:
            ax.set_ylabel("needle depth", fontsize=8)
    for ax in list(axes.flat)[len(grids):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=path.parent or ".")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    except OSError as exc:
        raise UsageError(f"--plot: cannot write {path} ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
