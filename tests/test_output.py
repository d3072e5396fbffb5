"""Progress on stderr: a live bar with tokens/s on a terminal, throttled plain lines elsewhere."""

from __future__ import annotations

import io

from rich.console import Console

from icecache_cli import output


def test_plain_progress_lines_off_a_terminal(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(output, "stderr", Console(file=buf, force_terminal=False, width=120))
    times = iter([100.0, 100.0, 102.0, 112.0, 113.0, 200.0, 215.0, 300.0, 330.0])
    monkeypatch.setattr(output.time, "monotonic", lambda: next(times))
    rep = output.Reporter()
    assert not rep.live
    rep.progress("prefill", 0, 1000)  # starts the clock
    rep.progress("prefill", 100, 1000)  # 0 s later: too soon
    rep.progress("prefill", 200, 1000)  # 2 s: too soon
    rep.progress("prefill", 600, 1000)  # 12 s after the start: a line
    rep.progress("prefill", 650, 1000)  # 1 s after that line: too soon
    rep.close()
    rep.progress("prefill", 100, 400)  # a new prefill: the clock starts again from its first report
    rep.progress("prefill", 250, 400)  # 15 s later: 150 tokens in 15 s
    rep.close()
    rep.progress("cells", 1, 10)  # eval counts cells, not tokens (here one per 30 s)
    rep.progress("cells", 2, 10)
    lines = buf.getvalue().splitlines()
    assert lines == ["prefill: 600/1000 tokens, 50 tokens/s, about 8 s left",
                     "prefill: 250/400 tokens, 10 tokens/s, about 15 s left",
                     "cells: 2/10 cells, 2.0 cells/min, about 240 s left"]
    quiet = output.Reporter(quiet=True)
    quiet.progress("prefill", 10, 20)
    assert buf.getvalue().splitlines() == lines


def test_live_bar_on_a_terminal_shows_rate(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(output, "stderr", Console(file=buf, force_terminal=True, width=120))
    rep = output.Reporter()
    assert rep.live
    for done in range(0, 1001, 100):
        rep.progress("prefill", done, 1000)
    rep.close()
    text = buf.getvalue()
    assert "prefill" in text and "1000/1000" in text and "tokens" in text
