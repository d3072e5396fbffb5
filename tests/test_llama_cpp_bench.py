"""The llama.cpp row of ``icecache bench`` (llama-cpp-python is optional: a stand-in plays it,
and one test runs the real one where it is installed)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from icecache.bench import llama_cpp

VOCAB = 50


class FakeLlama:
    """Records what it is fed; its logits after a token t point at (3 t + 1) mod VOCAB."""

    def __init__(self):
        self.fed: list[list[int]] = []

    def eval(self, tokens):
        self.fed.append(list(tokens))

    def logits(self) -> np.ndarray:
        out = np.zeros(VOCAB, np.float32)
        out[(3 * self.fed[-1][-1] + 1) % VOCAB] = 1.0
        return out


def test_the_prompt_goes_in_chunks_then_greedy_steps_are_timed():
    llm = FakeLlama()
    ids = [i % VOCAB for i in range(2 * llama_cpp.CHUNK + 5)]
    seen = []
    run = llama_cpp.LlamaSteps(llm, FakeLlama.logits, ids, warmup=2, on_progress=lambda d, n: seen.append((d, n)))
    run.advance(4)
    t = run.timing()
    C = llama_cpp.CHUNK
    assert llm.fed[:3] == [ids[:C], ids[C : 2 * C], ids[2 * C :]]
    assert seen == [(C, len(ids)), (2 * C, len(ids)), (len(ids), len(ids))]
    # each step feeds the greedy token of the logits before it
    expect, tok = [], (3 * ids[-1] + 1) % VOCAB
    for _ in range(6):
        expect.append(tok)
        tok = (3 * tok + 1) % VOCAB
    assert [f for f in llm.fed[3:]] == [[x] for x in expect] and t.tokens == expect
    assert len(t.times) == 4 and all(x > 0 for x in t.times)
    assert t.tt2t_s > t.prefill_s > 0
    assert t.tpot_p90_ms >= t.tpot_ms > 0
    assert t.tpot_mean_ms == pytest.approx(1000 * sum(t.times) / 4)


def test_kv_cache_bytes_are_float16_keys_and_values_of_every_layer(loaded):
    cfg = loaded.model.config  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    assert llama_cpp.kv_cache_bytes(cfg, 1000) == 2 * 2 * 30 * 3 * 64 * 1000


def test_bench_row_beside_the_icecache_methods(loaded, cpu_settings, monkeypatch):
    """``run_ctx`` with llama.cpp: its own prefill first, then its steps timed in turns with each
    icecache method's (``TURNS`` blocks), each of our rows carrying its ratio to the llama.cpp
    steps of its turns as it comes, llama.cpp's row last; a failed or skipped row (with the
    reason) when it cannot run."""
    from icecache.bench import full_bench

    calls, events = [], []

    class Logged(FakeLlama):
        """Logs its evals; slow (3 ms a step) in the dense method's turns."""

        def eval(self, tokens):
            super().eval(tokens)
            ours = [e for e in events if e != "llama"]
            if ours and ours[-1] == "dense":
                time.sleep(0.003)
            events.append("llama")

    def fake_open(gguf, ids, steps, warmup, threads, on_progress=None):
        calls.append((gguf, list(ids), steps, warmup, threads))
        return llama_cpp.LlamaSteps(Logged(), FakeLlama.logits, [i % VOCAB for i in ids], warmup, on_progress)

    monkeypatch.setattr(llama_cpp, "open_run", fake_open)
    monkeypatch.setattr(llama_cpp, "missing", lambda: None)
    settings = cpu_settings.replace(budget=64)
    seen = []
    steps, methods = 5, ["full", "dense", "llama.cpp"]
    rows = full_bench.run_ctx(loaded, settings, methods, 300, steps=steps, warmup=1,
                              on_step=lambda done, total, times, s: events.append(s.method),
                              on_row=lambda r: seen.append((r.method, r.tpot_ratio_vs_llama_cpp)),
                              gguf=llama_cpp.gguf_of(None))
    assert [m for m, _ in seen] == ["full", "dense", "llama.cpp"] and seen[0][1] > 0 and seen[1][1] > 0
    assert [r.method for r in rows] == methods  # in the order asked for
    full, dense, lc = rows
    assert lc.status == "ok" and lc.kv_source == "own prefill (llama.cpp)"
    # its context holds the prompt, its warm-up and the steps taken beside both methods
    assert calls[0][0].name.endswith(".gguf") and len(calls[0][1]) == 300 and calls[0][2:4] == (2 * steps, 1)
    assert lc.prefill_tok_s > 0 and lc.tpot_ms > 0 and lc.peak_rss_bytes > 0
    assert lc.device_kv_bytes == llama_cpp.kv_cache_bytes(loaded.model.config, 300 + 1 + 2 * steps + 1)
    # the turns: after the prefill (its chunk of 300) and one warm-up step, each method's timed
    # steps in TURNS blocks (5 steps: 1, 1, 1, 2), llama.cpp as many after each block
    after_prompt = events[events.index("llama") + 2:]
    for method in ("full", "dense"):
        mine = after_prompt[after_prompt.index(method) + 1:]  # (its first, untimed, step before)
        turns = []
        for e in mine:
            if e not in (method, "llama"):
                break
            if not turns or turns[-1][0] != e:
                turns.append([e, 0])
            turns[-1][1] += 1
        assert turns == [[method, 1], ["llama", 1]] * 3 + [[method, 2], ["llama", 2]], (method, turns)
    # each ratio is to the llama.cpp steps timed in the method's turns, not to the row's median
    assert full.tpot_ms * full.tpot_ratio_vs_llama_cpp < 3.0 <= dense.tpot_ms * dense.tpot_ratio_vs_llama_cpp
    assert lc.tpot_ratio_vs_full == pytest.approx(full.tpot_ms / lc.tpot_ms)

    def broken(*_a, **_k):
        raise ValueError("Failed to load model from file: x.gguf\nmore")

    monkeypatch.setattr(llama_cpp, "open_run", broken)
    rows = full_bench.run_ctx(loaded, settings, ["llama.cpp"], 300, steps=1, warmup=1, gguf=llama_cpp.gguf_of(None))
    assert rows[0].status == "failed" and rows[0].reason == "Failed to load model from file: x.gguf"
    monkeypatch.setattr(llama_cpp, "open_run", fake_open)
    monkeypatch.setattr(llama_cpp, "missing", lambda: "no llama-cpp-python here")
    rows = full_bench.run_ctx(loaded, settings, ["llama.cpp"], 300, steps=1, warmup=1, gguf=llama_cpp.gguf_of(None))
    assert rows[0].status == "skipped" and rows[0].reason == "no llama-cpp-python here"
    assert len(calls) == 1


def test_llama_cpp_alone_times_its_own_steps(loaded, cpu_settings, monkeypatch):
    """With no icecache method beside it, llama.cpp takes its steps in one go."""
    from icecache.bench import full_bench

    llm = FakeLlama()
    monkeypatch.setattr(llama_cpp, "open_run", lambda gguf, ids, steps, warmup, threads, on_progress=None:
                        llama_cpp.LlamaSteps(llm, FakeLlama.logits, [i % VOCAB for i in ids], warmup))
    monkeypatch.setattr(llama_cpp, "missing", lambda: None)
    rows = full_bench.run_ctx(loaded, cpu_settings, ["llama.cpp"], 300, steps=3, warmup=1, gguf=llama_cpp.gguf_of(None))
    assert rows[0].status == "ok" and rows[0].tpot_ms > 0 and rows[0].tt2t_s > 0
    assert len(llm.fed) == 1 + 1 + 3  # the prompt (one chunk), the warm-up step, the timed steps


def _shadow(tmp_path, body: str) -> dict:
    """An environment whose ``import llama_cpp`` finds ``body`` first."""
    import os

    (tmp_path / "llama_cpp.py").write_text(body)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


def test_cli_refuses_llama_cpp_without_the_package_or_a_gguf(tmp_path):
    from .conftest import run_cli

    r = run_cli(["bench", "--ctx", "1k", "--methods", "ice,llama.cpp"],
                env=_shadow(tmp_path, "raise ImportError('not installed')\n"))
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "pip install llama-cpp-python" in err and len(err.splitlines()) == 1, err
    folder = tmp_path / "model"
    folder.mkdir()
    r = run_cli(["bench", "--ctx", "1k", "--methods", "llama.cpp", "--model", str(folder)],
                env=_shadow(tmp_path, ""))
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and "GGUF files only" in err and len(err.splitlines()) == 1, err


def test_real_llama_cpp_reads_the_same_tokens(loaded, cpu_settings):
    """Where llama-cpp-python is installed: the embedded GGUF through llama.cpp continues the same
    prompt ids with the greedy tokens the icecache model (full attention) picks."""
    pytest.importorskip("llama_cpp")
    import torch

    dies = llama_cpp.crashes(llama_cpp.gguf_of(None))
    if dies is not None:  # the installed build is for another CPU: nothing of icecache to test
        pytest.skip(dies)
    from icecache.bench.decode_bench import context_ids
    from icecache.generation import Session

    ids = context_ids(loaded.tokenizer, 200)
    held = llama_cpp.open_run(llama_cpp.gguf_of(None), ids, steps=6, warmup=0, threads=torch.get_num_threads())
    try:
        held.advance(6)
    finally:
        llama_cpp.close(held.llm)
    t = held.timing()
    session = Session(loaded, cpu_settings, "full")
    with torch.inference_mode():
        logits, _ = session.prefill(ids)
        ours = []
        for _ in range(6):
            ours.append(int(torch.argmax(logits)))
            logits = session.forward([ours[-1]])
    assert t.tokens == ours
    print(json.dumps({"llama.cpp": t.tokens, "icecache": ours}))


def test_a_llama_cpp_build_that_dies_on_this_cpu_is_caught_in_a_child_process(tmp_path, monkeypatch):
    """A native library built for other instructions kills its process with SIGILL (no exception
    to catch): the probe runs in a child, and the bench names the cause instead of dying."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llama_cpp, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    why = llama_cpp.crashes(gguf)
    assert why is not None and "SIGILL" in why and "rebuild it for this CPU" in why
    monkeypatch.setattr(llama_cpp, "_PROBE", "import sys; assert sys.argv[1].endswith('m.gguf')")
    assert llama_cpp.crashes(gguf) is None
