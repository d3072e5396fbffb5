"""The live panel (forced-terminal rich console and a real pseudo-terminal), streamed text and
``--stats``."""

from __future__ import annotations

import io
import json
import os
import pty
import re

import pytest
from rich.console import Console

from icecache_cli import output
from icecache_cli.live import LivePanel, TextStream, same_terminal

from .conftest import EXAMPLE, on_pty, run_cli


class FakeTokenizer:
    """Tokens are pieces of text; piece 9 is half of a two-byte character (as byte-level BPE
    decodes a partial UTF-8 sequence)."""

    pieces = {1: " Hello", 2: ",", 3: " world", 4: " ", 5: "\n", 6: "caf", 7: "é", 8: "!", 9: "\ufffd"}

    def decode(self, ids):
        text = "".join(self.pieces[i] for i in ids)
        return text.replace("\ufffd\ufffd", "é")  # two halves make the character


def stream_of(generations, segments=None, tail="\n"):
    out = []
    s = TextStream(FakeTokenizer().decode, out.append, segments)
    for gen in generations:
        s.tokens_now([])
        for n in range(1, len(gen) + 1):
            s.tokens_now(gen[:n])
    s.finish(tail)
    return out


def test_streamed_text_equals_the_final_text_and_holds_back_unfinished_parts():
    ids = [1, 2, 4, 3, 5, 4, 6, 9, 9, 8, 4]
    parts = stream_of([ids])
    final = FakeTokenizer().decode(ids).strip()  # what the command prints at the end
    assert final == "Hello,  world\n café!"
    assert "".join(parts) == final + "\n"
    # Nothing written could change later: a half character and trailing spaces wait.
    assert all("\ufffd" not in p for p in parts)
    assert not any(p.endswith(" ") for p in parts[:-1])
    assert len(parts) >= 4  # written as it came, not at the end


def test_streamed_answers_carry_the_final_layout():
    parts = stream_of([[1, 3], [], [4, 6, 7]], segments=["Q: a?\nA: ", "\n\nQ: b?\nA: ", "\n\nQ: c?\nA: "])
    assert "".join(parts) == "Q: a?\nA: Hello world\n\nQ: b?\nA: \n\nQ: c?\nA: café\n"


def test_same_terminal():
    master, slave = pty.openpty()
    other_master, other_slave = pty.openpty()
    r, w = os.pipe()
    try:
        assert same_terminal(slave, os.dup(slave))
        assert not same_terminal(slave, other_slave)
        assert not same_terminal(slave, w)
    finally:
        for fd in (master, slave, other_master, other_slave, r, w):
            os.close(fd)


def test_panel_renders_phase_progress_latency_memory_pages_and_text():
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=100)
    p = LivePanel(con, "icecache summarize (ice)", show_text=True)
    p.prefill(0, 4096)
    p.prefill(2048, 4096)
    p.decode(3, 64, [0.070, 0.050, 0.060])
    p.pages_per_step = 12
    p.mem = {"device_kv_bytes": 5 * 2**20, "host_kv_bytes": 300 * 2**20, "rss_bytes": 3 * 2**30,
             "pool_occupancy": 0.75}
    p.text = "line one\nline two"
    con.print(p)
    text = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
    for want in ("icecache summarize (ice)", "decode", "2,048/4,096 tokens", "3 of at most 64 tokens",
                 "last 60.0 ms, median 60.0 ms", "12 per step", "resident KV 5.0 MiB", "75% full",
                 "store 300.0 MiB", "3.00 GiB", "line two"):
        assert want in text, want


def test_reporter_panel_on_a_terminal_and_plain_lines_on_a_dumb_one(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setattr(output, "stderr", Console(file=buf, force_terminal=True, width=100))
    rep = output.Reporter(panel="icecache qa (ice)")
    assert rep.panel is not None
    rep.memory_probe = lambda: {"device_kv_bytes": 2**20, "host_kv_bytes": 0, "rss_bytes": 2**30}
    rep.progress("prefill", 512, 1024)
    rep.token([5, 6], 32, [0.04])
    rep.finish()
    text = buf.getvalue()
    assert "icecache qa (ice)" in text and "done" in text and "2 of at most 32" in text
    # TERM=dumb: no cursor movement, so no panel and no bar; plain throttled lines instead.
    buf2 = io.StringIO()
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.setattr(output, "stderr", Console(file=buf2, force_terminal=True, width=100))
    rep = output.Reporter(panel="icecache qa (ice)")
    assert rep.panel is None and not rep.live
    rep.progress("prefill", 10, 20)
    rep.finish()
    assert "\x1b[" not in buf2.getvalue()
    # --quiet: nothing.
    monkeypatch.setenv("TERM", "xterm-256color")
    rep = output.Reporter(quiet=True, panel="x")
    assert rep.panel is None


def test_real_terminal_run_shows_the_panel_and_streams_the_same_text(tmp_path):
    args = ["summarize", str(EXAMPLE), "--method", "ice", "--max-new-tokens", "12", "--budget", "64"]
    with open(tmp_path / "out.txt", "w") as out:
        rc, screen, _ = on_pty(args + ["--stats"], stdout=out)
    assert rc == 0, screen[-2000:]
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert "icecache summarize (ice)" in plain and "per token" in plain and "resident KV" in plain
    assert "phase" in plain and "done" in plain
    stats = [line for line in plain.splitlines() if line.startswith("stats: ")]
    assert len(stats) == 1 and "tpot_ms=" in stats[0] and "tpot_mean_ms=" in stats[0] and "peak_rss_bytes=" in stats[0]
    # Off a terminal the same command prints the whole text at the end: the streamed copy matches.
    ref = run_cli(args + ["--stats", "--json"], stdin=None)
    assert ref.returncode == 0, ref.stderr.decode()[-2000:]
    result = json.loads(ref.stdout.decode().strip().splitlines()[-1])
    assert (tmp_path / "out.txt").read_text() == result["output"] + "\n"
    line = [x for x in ref.stderr.decode().splitlines() if x.startswith("{")]
    assert json.loads(line[-1])["new_tokens"] == result["tokens_out"]


@pytest.mark.parametrize("flag", ["--quiet"])
def test_stats_line_even_when_quiet(flag):
    r = run_cli(["summarize", str(EXAMPLE), "--max-new-tokens", "4", "--stats", flag], stdin=None)
    assert r.returncode == 0
    lines = r.stderr.decode().splitlines()
    # ice by default; the run's prefill, positions and weights as it chose them for a short
    # document on the embedded model (its Q4_1 layers: int4), every layer dense (dense_until)
    assert len(lines) == 1 and lines[0].startswith(
        "stats: method=ice prefill=full positions=true all_dense=True rope_scaling=none weights=int4 template=own "
            "prompt_tokens=")
