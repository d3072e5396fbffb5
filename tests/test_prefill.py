"""Prefill of the ice cache: the pipelined offload and index build against the serial one, and
the sparse (chunk-by-chunk page selection) prefill against full attention."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from icecache.cache import IceCache
from icecache.cache.dense import windowed_dense
from icecache.cache.paged import chunk_positions, paged_chunk_flash, paged_chunk_reference, paged_chunk_sdpa
from icecache.errors import UsageError
from icecache.methods import make_cache, prepare_model

from .test_ice_cache import full_cache, spec, tiny_model


def chunked(model, cache, prompt, forced, chunk):
    """Prefill ``prompt`` in chunks (announced to the cache), then feed ``forced``; logits."""
    out = []
    with torch.inference_mode():
        if hasattr(cache, "begin_prefill"):
            cache.begin_prefill(len(prompt))
        for lo in range(0, len(prompt), chunk):
            r = model(input_ids=torch.tensor([prompt[lo : lo + chunk]]), past_key_values=cache,
                      use_cache=True, logits_to_keep=1)
        if hasattr(cache, "end_prefill"):
            cache.end_prefill()
        out.append(r.logits[0, -1])
        for t in forced:
            r = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            out.append(r.logits[0, -1])
    return out


def ice(model, s, dense=1, reuse=1):
    prepare_model("ice", model)
    return IceCache(model.config.num_hidden_layers, s, dense_layers=dense, reuse_every=reuse)


@pytest.mark.parametrize("reuse", [1, 2])
def test_pipelined_prefill_builds_the_same_cache_as_serial(reuse):
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(5)
    prompt, forced = rng.integers(0, 97, 260).tolist(), rng.integers(0, 97, 25).tolist()
    caches, logits = [], []
    from icecache.cache.worker import THREAD_PREFIX, WORKER

    jobs = []
    real = WORKER.submit
    WORKER.submit = lambda fn, *a: jobs.append(fn) or real(fn, *a)
    try:
        for pipeline in (True, False):
            cache = ice(model, dataclasses.replace(spec(budget_pages=6), pipeline=pipeline), reuse=reuse)
            logits.append(chunked(model, cache, prompt, forced, chunk=64))
            caches.append(cache)
    finally:
        del WORKER.submit
    assert jobs  # the pipelined prefill ran work in the background ...
    # ... and its worker thread ended once idle (an idle OpenMP master slows the model's ops)
    assert not WORKER.alive
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]
    for a, b in zip(*logits, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for la, lb in zip(caches[0].ice_layers(), caches[1].ice_layers(), strict=True):
        assert la.offloaded and lb.offloaded and la.keys is None
        torch.testing.assert_close(la.resident.keys, lb.resident.keys, atol=0, rtol=0)
        torch.testing.assert_close(la.store.keys[:, : la.store.rows], lb.store.keys[:, : lb.store.rows],
                                   atol=0, rtol=0)
        if la.anchor is None:
            for ta, tb in zip(la.selector.indexes, lb.selector.indexes, strict=True):
                np.testing.assert_array_equal(ta.members[: ta.npages], tb.members[: tb.npages])
    assert caches[0].stats.index_build_s > 0


def test_prefill_finalizes_at_end_of_prefill_and_decodes_like_full():
    model = tiny_model("qwen3", 2)
    rng = np.random.default_rng(6)
    prompt, forced = rng.integers(0, 97, 200).tolist(), rng.integers(0, 97, 30).tolist()
    ref = chunked(model, full_cache(model), prompt, forced, chunk=64)
    got = chunked(model, ice(model, spec(budget_pages=256)), prompt, forced, chunk=64)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,kv_heads,reuse", [("llama", 2, 1), ("llama", 2, 2), ("qwen2", 1, 1)])
def test_sparse_prefill_with_room_for_everything_equals_full(arch, kv_heads, reuse):
    """Each chunk selects pages; with room for every page and a dense window over the whole
    prompt, sparse prefill computes what full attention computes, through decode evictions."""
    model = tiny_model(arch, kv_heads)
    rng = np.random.default_rng(7)
    prompt, forced = rng.integers(0, 97, 300).tolist(), rng.integers(0, 97, 30).tolist()
    ref = chunked(model, full_cache(model), prompt, forced, chunk=64)
    s = dataclasses.replace(spec(budget_pages=256), sparse_prefill=True, prefill_pages=256,
                            chunk_tokens=64, dense_window=4096)
    s = dataclasses.replace(s, tuning=dataclasses.replace(s.tuning, index_beam=100_000))
    cache = ice(model, s, reuse=reuse)
    got = chunked(model, cache, prompt, forced, chunk=64)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=3e-4, rtol=1e-4)
    layer = cache.ice_layers()[0]
    r = layer.resident
    assert layer.length == 330 and r.sink_fill + layer.store.rows + r.window_fill == 330
    # after the prefill the resident buffer shrank to the decode pool and one page of slack
    assert r.window_cap == s.window_tokens + s.page_size
    assert r.rows == s.sink_tokens + 256 * 4 + r.window_cap


def test_sparse_prefill_memory_stays_bounded():
    """A small budget: the resident buffer is fixed while the host store takes the document."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(8)
    s = dataclasses.replace(spec(budget_pages=4), sparse_prefill=True, prefill_pages=8,
                            chunk_tokens=32, dense_window=64)
    cache = ice(model, s)
    sizes = []
    with torch.inference_mode():
        cache.begin_prefill(640)
        for lo in range(0, 640, 32):
            model(input_ids=torch.tensor([rng.integers(0, 97, 32).tolist()]), past_key_values=cache,
                  use_cache=True, logits_to_keep=1)
            if lo >= 64:
                sizes.append(sum(layer.device_bytes() for layer in cache.ice_layers()))
        cache.end_prefill()
    assert len(set(sizes)) == 1  # resident bytes do not grow with the prompt
    layer = cache.ice_layers()[0]
    assert layer.store.rows >= 640 - 8 - 8 - 32 and cache.host_kv_bytes() > 0
    assert sum(len(t.members[: t.npages]) for t in layer.selector.indexes) > 0


def test_chunk_attention_sdpa_matches_reference():
    torch.manual_seed(1)
    H, G, C, L, d = 2, 3, 5, 30, 8
    q = torch.randn(H, G, C, d)
    k, v = torch.randn(H, L, d), torch.randn(H, L, d)
    valid = torch.rand(H, L) > 0.3
    valid[:, 20:25] = True  # the chunk's rows
    got = paged_chunk_sdpa(q, k, v, valid, 20, 0.3)
    torch.testing.assert_close(got, paged_chunk_reference(q, k, v, valid, 20, 0.3), atol=1e-5, rtol=1e-5)
    # query 0 of the chunk cannot see the chunk's later rows
    k2 = k.clone()
    k2[:, 21:25] = 1e3
    torch.testing.assert_close(paged_chunk_sdpa(q, k2, v, valid, 20, 0.3)[:, :, 0], got[:, :, 0],
                               atol=1e-5, rtol=1e-5)
    # the maskless path (CPU): the same, valid rows after the chunk included, and a head that sees
    # nothing outside the chunk
    torch.testing.assert_close(paged_chunk_flash(q, k, v, valid, 20, 0.3), got, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_chunk_flash(q, k2, v, valid, 20, 0.3)[:, :, 0], got[:, :, 0],
                               atol=1e-5, rtol=1e-5)
    lonely = valid.clone()
    lonely[1, :20] = lonely[1, 25:] = False
    torch.testing.assert_close(paged_chunk_flash(q, k, v, lonely, 20, 0.3),
                               paged_chunk_reference(q, k, v, lonely, 20, 0.3), atol=1e-5, rtol=1e-5)
    assert chunk_positions(2048, 8).tolist()[-1] == 2047 and len(chunk_positions(2048, 8)) == 8
    assert chunk_positions(3, 8).tolist() == [0, 1, 2]


def test_windowed_dense_matches_masked_full_attention():
    torch.manual_seed(2)
    n, C, d, sink, window = 50, 6, 8, 4, 10
    q = torch.randn(1, 4, C, d)
    k, v = torch.randn(1, 2, n, d), torch.randn(1, 2, n, d)
    got = windowed_dense(q, k, v, sink, window, 0.5)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    pos_q = torch.arange(n - C, n)[:, None]
    pos_k = torch.arange(n)[None, :]
    mask = (pos_k < sink) | ((pos_k >= n - C - window) & (pos_k <= pos_q))
    scores = (q @ kk.transpose(-1, -2)) * 0.5
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vv
    torch.testing.assert_close(got, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert windowed_dense(q, k, v, sink, 40, 0.5) is None  # everything fits: plain attention


def test_sparse_prefill_refused_for_methods_without_pages(cpu_settings, loaded):
    with pytest.raises(UsageError, match="--prefill sparse"):
        make_cache("full", loaded.model, cpu_settings.replace(prefill="sparse"))
    with pytest.raises(UsageError, match="--prefill sparse"):
        make_cache("snapkv", loaded.model, cpu_settings.replace(prefill="sparse"))


@pytest.mark.slow  # 1.5 minutes; the passkey evals cover it at length
def test_sparse_prefill_passkey_like_full_prefill(cpu_settings, loaded):
    """The embedded model, ~1.5k tokens in chunks of 256: the sparse prefill (each chunk attends to
    64 selected pages' worth of 256 tokens, dense layers to the last 512) finds the passkey
    where the full prefill does; streaming's sparse prefill (no pages) is the failing control."""
    from icecache.evals import passkey
    from icecache.generation import Session

    tok = loaded.tokenizer
    base = cpu_settings.replace(chunk_size=256, budget=64)
    sparse = base.replace(prefill="sparse", prefill_budget=256, dense_window=512)
    results = {}
    for name, method, settings in [("full", "ice", base), ("sparse", "ice", sparse),
                                   ("streaming", "streaming", sparse)]:
        for case in passkey.cases(tok, 1500, 3, seed=5):  # depths 0, 0.5, 1
            out, stats = Session(loaded, settings, method).generate(tok(case.prompt)["input_ids"], 7)
            results.setdefault(name, []).append(passkey.score(tok.decode(out), case.answer))
    assert results["full"] == [1.0, 1.0, 1.0]
    assert results["sparse"] == results["full"]
    assert results["streaming"][1] == 0.0


def test_cli_sparse_prefill_json_memory_and_refusal(quick_profile):
    import json

    from .conftest import EXAMPLE, run_cli

    r = run_cli(["summarize", str(EXAMPLE), "--method", "ice", "--prefill", "sparse", "--chunk-size",
                 "256", "--budget", "64", "--max-new-tokens", "8", "--json", "--profile", quick_profile])
    assert r.returncode == 0, r.stderr.decode()
    doc = json.loads(r.stdout)
    mem = doc["memory"]
    assert mem["peak_rss_bytes"] > 0 and mem["host_kv_bytes"] > 0 and mem["device_kv_bytes"] > 0
    assert "sparse prefill" in r.stderr.decode() and "peak RSS" in r.stderr.decode()
    bad = run_cli(["summarize", str(EXAMPLE), "--method", "full", "--prefill", "sparse"])
    assert bad.returncode == 2 and "--prefill sparse works with" in bad.stderr.decode()
    bad = run_cli(["summarize", str(EXAMPLE), "--method", "ice", "--prefill", "half"])
    assert bad.returncode == 2 and "--prefill must be one of full, sparse" in bad.stderr.decode()


def test_sparse_prefill_context_limit_and_warning(cpu_settings, loaded):
    from icecache.tasks import Runner

    full = Runner(loaded, cpu_settings.replace(prefill="full"), "ice")
    assert full.context_limit == loaded.context_length  # 8192 for the embedded model
    assert Runner(loaded, cpu_settings, "full").context_limit == loaded.context_length
    for prefill in ("sparse", "auto"):
        sparse = Runner(loaded, cpu_settings.replace(prefill=prefill), "ice")
        assert sparse.context_limit == cpu_settings.max_context > loaded.context_length
    true = Runner(loaded, cpu_settings.replace(prefill="sparse", positions="true"), "ice")
    assert true.beyond_trained(100, 10) is None
    assert "trained on" in true.beyond_trained(loaded.context_length, 10)
    notes = []
    sparse.note = notes.append
    # auto: the prompt fits the trained context (full prefill), the generation goes past it (remap)
    assert sparse.beyond_trained(loaded.context_length, 10) is None
    assert notes == [f"full prefill, remap positions ({loaded.context_length} prompt tokens, "
                     f"{loaded.context_length} trained)"]


LOW = 16  # the smaller budget the forks take


@pytest.mark.parametrize("method,positions,spans", [
    pytest.param("ice", "true", 0, marks=pytest.mark.slow), pytest.param("ice", "remap", 0, marks=pytest.mark.slow),
    ("ice", "remap", 3),
    pytest.param("ice-reuse", "true", 0, marks=pytest.mark.slow)])
def test_fork_to_another_budget_decodes_like_its_own_prefill(cpu_settings, loaded, method, positions, spans):
    """One sparse prefill, forked to other budgets (what eval does per case): each fork's greedy
    tokens equal those of a session that prefilled with that budget itself, and the forks do not
    disturb the prefilled session or each other."""
    from icecache.generation import Session
    from icecache.textgen import generated_text

    tok = loaded.tokenizer
    ids = tok(generated_text(900, seed=11))["input_ids"][:1400]
    # prefill_queries 4: the prompt's last 8 tokens run as held tail steps (16 in the profile; the
    # fork's handling of them does not depend on how many)
    # spans 0: window 2 and no pinned passages, where budgets 16 and 128 part on this prompt (32
    # and 128 did with projection pages, not with the cpu profile's similar pages);
    # spans 3: the cpu profile's window and passages (there the two budgets give the same tokens)
    base = cpu_settings.replace(chunk_size=256, prefill="sparse", prefill_budget=256, dense_window=512,
                                positions=positions, prefill_queries=4,
                                window_pages=8 if spans else 2, answer_spans=spans)
    steps = 12
    want = {}
    for budget in (LOW, 128):
        s = Session(loaded, base.replace(budget=budget), method)
        want[budget] = s.generate(ids, steps)[0]
    if not spans:
        assert want[LOW] != want[128]  # the budget matters here, so equality below means something
    session = Session(loaded, base.replace(budget=128), method)
    session.new_tokens = steps
    logits, _ = session.prefill(ids, hold_tail=True)  # the prompt's last tokens not stepped yet
    assert logits is None and session.positions == positions
    twin = session.fork(base.replace(budget=LOW))  # carries the tail, steps it itself
    stores = [(a.store, b.store) for a, b in zip(session.cache.ice_layers(), twin.cache.ice_layers(), strict=True)]
    assert all(a.keys.data_ptr() == b.keys.data_ptr() for a, b in stores)  # shared until written
    assert twin.decode(twin.finish_prefill(), steps)[0] == want[LOW]
    # its 20 steps offloaded a window page per layer: into its own copies, the session's untouched
    assert all(a.keys.data_ptr() != b.keys.data_ptr() and b.rows > a.rows for a, b in stores)
    again = session.fork(base.replace(budget=128))  # the fork left the prefilled session as it was
    assert again.decode(again.finish_prefill(), steps)[0] == want[128]
    done = session.fork(base.replace(budget=128))
    tail_logits = done.finish_prefill()  # the tail stepped, nothing generated yet: eval forks here
    after = done.fork(base.replace(budget=LOW))
    assert after.decode(tail_logits.clone(), steps)[0] == want[LOW]
    assert session.decode(session.finish_prefill(), steps)[0] == want[128]
    with pytest.raises(ValueError, match="only a prefilled cache"):
        session.fork(base.replace(budget=32))  # it decoded since
    with pytest.raises(ValueError, match="budget only"):
        Session(loaded, base, method).fork(base.replace(budget=32, sink_pages=1))


def test_fork_refused_where_the_budget_shaped_the_prefill(cpu_settings, loaded):
    """A full prefill sizes the pool by the budget, SnapKV's index holds one budget's choice:
    forking either would not be exact, so it is refused."""
    from icecache.generation import Session

    ids = loaded.tokenizer("The harbor report. " * 60)["input_ids"]
    full = cpu_settings.replace(chunk_size=256, prefill="full", budget=64)
    s = Session(loaded, full, "ice")
    s.new_tokens = 4
    s.prefill(ids)
    with pytest.raises(ValueError, match="pool size"):
        s.fork(full.replace(budget=32))
    snap = Session(loaded, full, "snapkv")
    snap.new_tokens = 4
    snap.prefill(ids)
    with pytest.raises(ValueError):
        snap.fork(full.replace(budget=32))


def test_a_finished_cache_is_freed_once_the_session_lets_go():
    """Nothing but the session holds a cache: dropped (or replaced by the next prompt's), its
    memory goes at once (the attention functions' record of the running cache is weak; a strong
    one kept a 100k document's host store alive beside the next run's)."""
    import gc
    import weakref
    from types import SimpleNamespace

    from icecache.generation import Session

    from .test_pinned import SETTINGS
    from .test_pinned import tiny_model as pinned_model

    loaded = SimpleNamespace(model=pinned_model(), tokenizer=SimpleNamespace(eos_token_id=None), end_ids=frozenset())
    rng = np.random.default_rng(5)
    for prefill in ("full", "sparse"):
        session = Session(loaded, SETTINGS.replace(prefill=prefill), "ice")
        session.generate(rng.integers(0, 97, 300).tolist(), 4)
        first = weakref.ref(session.cache)
        session.generate(rng.integers(0, 97, 300).tolist(), 4)  # another prompt: a new cache
        gc.collect()
        assert first() is None
        second = weakref.ref(session.cache)
        session.cache = None
        gc.collect()
        assert second() is None
