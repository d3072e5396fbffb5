"""The live panel on stderr (a terminal only) and generated text streamed as it comes.

:class:`LivePanel` shows the phase (loading / prefill / decode), prefill progress and speed,
tokens generated, the last and median time per token, memory (device pool and dense layers, or
the GPU's allocation; host store; process RSS) and the pages loaded per step. It is a rich
``Live`` on the stderr console, so status lines printed meanwhile appear above it.

:class:`TextStream` turns the growing token list of each generation into text: it writes only
what can no longer change (a partial UTF-8 sequence or trailing spaces are held back) and, once
finished, has written exactly what the command would have printed at the end.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from icecache.measure import kv_bytes, rss_bytes


def same_terminal(fd_a: int, fd_b: int) -> bool:
    """Whether two file descriptors are the same terminal device."""
    try:
        if not (os.isatty(fd_a) and os.isatty(fd_b)):
            return False
        a, b = os.fstat(fd_a), os.fstat(fd_b)
        return (a.st_rdev, a.st_dev) == (b.st_rdev, b.st_dev)
    except OSError:
        return False


def memory_now(cache) -> dict:
    """Resident KV (device pool + dense layers), pool occupancy, host store, RSS, GPU allocation."""
    dev, host, _ = kv_bytes(cache)
    out = {"rss_bytes": rss_bytes(), "device_kv_bytes": dev, "host_kv_bytes": host}
    occ = getattr(cache, "pool_occupancy", None)
    if occ is not None:
        out["pool_occupancy"] = occ()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["gpu_allocated_bytes"] = torch.cuda.memory_allocated()
    except Exception:  # noqa: BLE001 - the panel must never break a run
        pass
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


class LivePanel:
    """State of one run, rendered by rich ``Live`` at a few frames per second."""

    def __init__(self, console, title: str, show_text: bool = False, text_lines: int = 6):
        self.console = console
        self.title = title
        self.show_text = show_text
        self.text_lines = text_lines
        self.phase = "loading"
        self.pre_done = self.pre_total = 0
        self.pre_t0: float | None = None
        self.pre_rate = 0.0
        self.tokens = 0
        self.max_tokens = 0
        self.step_ms: list[float] = []
        self.pages_per_step: float | None = None
        self.mem: dict = {}
        self.text = ""
        self._live: Live | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._live is None:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()

    def discard(self) -> None:
        """Stop and erase the panel from the terminal."""
        if self._live is not None:
            self._live.transient = True
        self.stop()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    # -- updates ----------------------------------------------------------------------------------
    def prefill(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.phase != "prefill" or done < self.pre_done:
            self.pre_t0, self.pre_base = now, done
        self.phase = "prefill"
        self.pre_done, self.pre_total = done, total
        if self.pre_t0 is not None and now > self.pre_t0 and done > self.pre_base:
            self.pre_rate = (done - self.pre_base) / (now - self.pre_t0)

    def decode(self, tokens: int, max_tokens: int, step_seconds: list[float]) -> None:
        if self.phase in ("loading", "prefill"):  # a caller's own phase text stays
            self.phase = "decode"
        self.tokens, self.max_tokens = tokens, max_tokens
        self.step_ms = [1000 * s for s in step_seconds]

    # -- rendering --------------------------------------------------------------------------------
    def __rich__(self):
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        t.add_row("phase", self.phase)
        if self.pre_total:
            bar = ProgressBar(total=self.pre_total, completed=self.pre_done, width=24)
            rate = f"{self.pre_rate:,.0f} tokens/s" if self.pre_rate else ""
            left = ""
            if self.pre_rate and self.pre_done < self.pre_total:
                left = f", about {(self.pre_total - self.pre_done) / self.pre_rate:.0f} s left"
            t.add_row("prefill", Group(bar, Text(f"{self.pre_done:,}/{self.pre_total:,} tokens  {rate}{left}")))
        if self.phase == "decode" or self.tokens:
            t.add_row("generated", f"{self.tokens} of at most {self.max_tokens} tokens")
            if self.step_ms:
                t.add_row("per token", f"last {self.step_ms[-1]:.1f} ms, median "
                                       f"{statistics.median(self.step_ms):.1f} ms")
            if self.pages_per_step is not None:
                t.add_row("pages loaded", f"{self.pages_per_step:.0f} per step")
        m = self.mem
        if m:
            if "gpu_allocated_bytes" in m:
                dev = f"GPU allocated {_mib(m['gpu_allocated_bytes'])}"
            else:
                dev = f"resident KV {_mib(m.get('device_kv_bytes'))} (CPU pool and dense layers)"
            if "pool_occupancy" in m:
                dev += f", pool {100 * m['pool_occupancy']:.0f}% full"
            t.add_row("device", dev)
            t.add_row("host", f"store {_mib(m.get('host_kv_bytes', 0))}, process RSS "
                              f"{m.get('rss_bytes', 0) / 2**30:.2f} GiB")
        body = [t]
        if self.show_text and self.text:
            lines = self.text.splitlines()[-self.text_lines :]
            body.append(Text("\n".join(lines), style="italic"))
        return Panel(Group(*body), title=self.title, title_align="left", expand=False)


class TextStream:
    """Writes generations' text as tokens arrive; ``finish`` completes it.

    ``segments``: the text printed before each generation (e.g. ``"Q: ...\\nA: "``); generations
    beyond the list get none. Each generation's text is stripped like the final output.
    """

    def __init__(self, decode: Callable[[list[int]], str], write: Callable[[str], None],
                 segments: list[str] | None = None):
        self.decode = decode
        self.write = write
        self.segments = segments or []
        self.index = -1
        self.printed = ""  # this generation's text written so far
        self.tokens: list[int] = []

    def tokens_now(self, tokens: list[int]) -> None:
        """The generation's tokens so far (an empty list starts a new generation)."""
        if not tokens:
            self._close_generation()
            self.index += 1
            if self.index < len(self.segments):
                self.write(self.segments[self.index])
            return
        self.tokens = list(tokens)
        text = self.decode(self.tokens).lstrip()
        safe = text.rstrip()
        while safe.endswith("\ufffd"):  # an unfinished multi-byte character
            safe = safe[:-1].rstrip()
        if safe.startswith(self.printed) and len(safe) > len(self.printed):
            self.write(safe[len(self.printed) :])
            self.printed = safe

    def _close_generation(self) -> None:
        if self.index >= 0:
            final = self.decode(self.tokens).strip() if self.tokens else ""
            if final.startswith(self.printed):
                self.write(final[len(self.printed) :])
        self.printed = ""
        self.tokens = []

    def finish(self, tail: str = "") -> None:
        self._close_generation()
        self.index = -1
        self.write(tail)
