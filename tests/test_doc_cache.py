"""The document cache: a prefix's prefill saved, loaded by a later run with the same output,
and every way an entry can be unusable (other model or settings, corrupt, truncated, another
format) costing a warning and a normal prefill; concurrent savers; the size cap."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from icecache.doc_cache import KV_FILE, LENGTHS, MANIFEST, DocCache, list_entries
from icecache.generation import Session
from tests.test_pinned import SETTINGS, tiny_model

PREFIX = 200  # the shared part of the prompts below


@pytest.fixture(scope="module")
def loaded():
    return SimpleNamespace(model=tiny_model(), tokenizer=SimpleNamespace(eos_token_id=None), end_ids=frozenset())


def prompt(question: int = 0) -> list[int]:
    doc = np.random.default_rng(5).integers(0, 97, PREFIX).tolist()
    return doc + np.random.default_rng(100 + question).integers(0, 97, 40).tolist()


def run(loaded, method: str, root, question: int = 0, warnings: list | None = None, settings=SETTINGS):
    settings = settings.replace(doc_cache=str(root), doc_cache_min_tokens=64)
    session = Session(loaded, settings, method)
    session.doc_cache = DocCache(root, loaded.model, settings, warn=(warnings if warnings is not None else []).append)
    session.doc_min_tokens = settings.doc_cache_min_tokens
    tokens, stats = session.generate(prompt(question), 12, prefix=PREFIX)
    return tokens, stats


@pytest.mark.parametrize("method", ["full", "dense", "ice", "ice-reuse", "quest"])
def test_second_run_loads_the_prefix_and_answers_the_same(loaded, tmp_path, method):
    first, s1 = run(loaded, method, tmp_path)
    assert s1.prefix_cached_tokens == 0 and s1.tokens_prefilled == PREFIX + 40
    assert len(list_entries(tmp_path)) == 1
    second, s2 = run(loaded, method, tmp_path)
    assert s2.prefix_cached_tokens == PREFIX and s2.tokens_prefilled == 40
    assert second == first
    # another question over the same document loads it too
    _, s3 = run(loaded, method, tmp_path, question=1)
    assert s3.prefix_cached_tokens == PREFIX


def test_one_entry_serves_every_method(loaded, tmp_path):
    """A full prefill is the same computation for every method: full's entry serves ice."""
    run(loaded, "full", tmp_path)
    want, _ = run(loaded, "ice", tmp_path / "other")
    got, stats = run(loaded, "ice", tmp_path)
    assert stats.prefix_cached_tokens == PREFIX and got == want


def test_other_settings_or_model_do_not_match(loaded, tmp_path):
    run(loaded, "full", tmp_path)
    _, stats = run(loaded, "full", tmp_path, settings=SETTINGS.replace(chunk_size=32))
    assert stats.prefix_cached_tokens == 0  # the chunking shapes the KV: its own entry
    assert len(list_entries(tmp_path)) == 2
    other = SimpleNamespace(model=tiny_model(), tokenizer=loaded.tokenizer, end_ids=frozenset())
    other.model.config.rms_norm_eps = 1e-3  # other weights or configuration
    _, stats = run(other, "full", tmp_path)
    assert stats.prefix_cached_tokens == 0


def test_snapkv_is_not_cached(loaded, tmp_path):
    _, stats = run(loaded, "snapkv", tmp_path)
    _, stats2 = run(loaded, "snapkv", tmp_path)
    assert stats.prefix_cached_tokens == stats2.prefix_cached_tokens == 0
    assert list_entries(tmp_path) == []


def run_sparse(loaded, method, root, changes, question_tokens):
    settings = SETTINGS.replace(prefill="sparse", doc_cache=str(root), doc_cache_min_tokens=64, **changes)
    session = Session(loaded, settings, method)
    session.doc_cache = DocCache(root, loaded.model, settings)
    session.doc_min_tokens = 64
    ids = prompt()[: PREFIX + question_tokens]
    tokens, stats = session.generate(ids, 12, prefix=PREFIX)
    pages = [[p.tolist() for p in layer.selected] for layer in session.cache.ice_layers()]
    return tokens, stats, pages


@pytest.mark.parametrize("question_tokens", [40, 5])  # after the document: chunks + tail, or tail only
@pytest.mark.parametrize("method,changes", [
    ("ice", {}), ("ice", {"positions": "remap"}), ("ice-reuse", {"reuse_every": 2}),
    ("quest", {}), ("streaming", {}), ("ice", {"pipeline": False}),
    ("ice", {"index_pages": "similar", "index_merge": "mass", "index_refine": 2}),
])
def test_sparse_prefill_state_round_trip(loaded, tmp_path, method, changes, question_tokens):
    """A sparse prefill's whole cache state (host store, index, window, pool) is saved at the
    document's end; a later run restores it and continues exactly as the saving run did."""
    first, s1, pages1 = run_sparse(loaded, method, tmp_path, changes, question_tokens)
    assert s1.prefix_cached_tokens == 0 and len(list_entries(tmp_path)) == 1
    second, s2, pages2 = run_sparse(loaded, method, tmp_path, changes, question_tokens)
    assert s2.prefix_cached_tokens == PREFIX and s2.tokens_prefilled == question_tokens
    assert second == first and pages2 == pages1
    # another budget or chunking is another entry (the state depends on every setting that shapes it)
    _, s3, _ = run_sparse(loaded, method, tmp_path, {**changes, "chunk_size": 32}, question_tokens)
    assert s3.prefix_cached_tokens == 0
    # ...but not on the profile's name, its description or the cache's own limits
    renamed = {**changes, "name": "a-copy", "description": "the same, renamed", "doc_cache_gib": 3.0}
    again, s5, _ = run_sparse(loaded, method, tmp_path, renamed, question_tokens)
    assert s5.prefix_cached_tokens == PREFIX and again == first
    # the entry serves a prompt whose part after the document is of the other kind (chunks and
    # steps, or steps only), and continues as a fresh run would
    other = 45 - question_tokens
    want, _, _ = run_sparse(loaded, method, tmp_path / "fresh", changes, other)
    got, s4, _ = run_sparse(loaded, method, tmp_path, changes, other)
    assert s4.prefix_cached_tokens == PREFIX and got == want


def test_sparse_state_serves_another_budget_within_the_chunks_pool(loaded, tmp_path):
    """Pages are re-selected at each step: an entry saved at one budget serves another that
    keeps the chunks' pool size (budget <= prefill_budget), as a fresh run at that budget."""
    run_sparse(loaded, "ice", tmp_path, {}, 40)  # budget 16 = prefill_budget
    want, _, _ = run_sparse(loaded, "ice", tmp_path / "fresh", {"budget": 8}, 40)
    got, stats, _ = run_sparse(loaded, "ice", tmp_path, {"budget": 8}, 40)
    assert stats.prefix_cached_tokens == PREFIX and got == want
    _, stats, _ = run_sparse(loaded, "ice", tmp_path, {"budget": 32}, 40)  # a larger pool: its own
    assert stats.prefix_cached_tokens == 0


def test_state_of_a_cache_saves_and_restores_exactly(loaded, tmp_path):
    """save_layers / load_layers alone: a restored copy of a prefilled cache decodes exactly as
    the original (tokens and selected pages at every step), restored from the tensors as held
    and from their file read back one tensor at a time (:class:`SavedTensors`, the document
    cache's path)."""
    from safetensors.torch import save_file

    from icecache.cache.state import load_layers, save_layers
    from icecache.doc_cache import SavedTensors
    from icecache.methods import make_cache

    settings = SETTINGS.replace(prefill="sparse")
    model = loaded.model
    ids = prompt()
    with torch.inference_mode():
        cache = make_cache("ice", model, settings)
        cache.begin_prefill(len(ids))
        for lo in range(0, len(ids), settings.chunk_size):
            model(input_ids=torch.tensor([ids[lo : lo + settings.chunk_size]]), past_key_values=cache, use_cache=True)
        skeleton, tensors = save_layers(cache)
        json.dumps(skeleton)  # JSON as it is
        save_file(tensors, str(tmp_path / KV_FILE))
        twins = [make_cache("ice", model, settings) for _ in range(2)]
        load_layers(twins[0], skeleton, tensors)
        load_layers(twins[1], skeleton, SavedTensors(tmp_path / KV_FILE))
        for t in [3, 14, 15, 92, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]:
            a = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits
            pages = [[p.tolist() for p in x.selected] for x in cache.ice_layers()]
            for twin in twins:
                b = model(input_ids=torch.tensor([[t]]), past_key_values=twin, use_cache=True).logits
                assert torch.equal(a, b)
                assert pages == [[p.tolist() for p in x.selected] for x in twin.ice_layers()]


def test_saved_tensors_read_one_at_a_time_equal_safetensors_own_reader(tmp_path):
    """:class:`SavedTensors` (the sparse state's reader: one tensor at a time, read into a new
    tensor) gives what safetensors' ``load_file`` gives, for every type the state saves and for
    empty and scalar tensors; a file whose header or data is cut short is refused."""
    from safetensors.torch import load_file, save_file

    from icecache.doc_cache import SavedTensors

    g = torch.Generator().manual_seed(3)
    tensors = {
        "f32": torch.randn(5, 7, generator=g), "f16": torch.randn(9, generator=g).half(),
        "bf16": torch.randn(3, 4, 2, generator=g).bfloat16(), "i64": torch.arange(-5, 6),
        "i32": torch.arange(12, dtype=torch.int32).reshape(3, 4), "i16": torch.tensor([-3, 7], dtype=torch.int16),
        "i8": torch.tensor([[-128, 127, 0]], dtype=torch.int8), "u8": torch.tensor([255, 1], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "f64": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 64),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    want, got = load_file(str(path)), SavedTensors(path)
    assert sorted(got) == sorted(want) and len(got) == len(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])  # the last tensor's bytes cut short
    with pytest.raises(ValueError, match="outside the file"):
        SavedTensors(tmp_path / "cut.safetensors")
    (tmp_path / "head.safetensors").write_bytes(data[:20])  # the header cut short
    with pytest.raises(ValueError):
        SavedTensors(tmp_path / "head.safetensors")


def _entry(root):
    (entry, _, _), = list_entries(root)
    return entry


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "format", "tokens", "manifest"])
def test_unusable_entry_is_rebuilt_with_a_warning(loaded, tmp_path, damage):
    first, _ = run(loaded, "ice", tmp_path)
    entry = _entry(tmp_path)
    kv, manifest = entry / KV_FILE, entry / MANIFEST
    data = bytearray(kv.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        kv.write_bytes(bytes(data))
    elif damage == "truncate":
        kv.write_bytes(bytes(data[: len(data) // 3]))
    elif damage in ("format", "tokens"):
        m = json.loads(manifest.read_text())
        if damage == "format":
            m["identity"]["format"] = 999
        else:
            m["tokens_sha256"] = "0" * 64
        manifest.write_text(json.dumps(m))
    else:
        manifest.write_text("{not json")
    warnings: list[str] = []
    again, stats = run(loaded, "ice", tmp_path, warnings=warnings)
    assert stats.prefix_cached_tokens == 0 and again == first
    assert len(warnings) == 1 and "not used" in warnings[0]
    _, stats = run(loaded, "ice", tmp_path)  # rebuilt by the run that rejected it
    assert stats.prefix_cached_tokens == PREFIX


def test_unwritable_folder_warns_and_the_task_goes_on(loaded, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    warnings: list[str] = []
    tokens, stats = run(loaded, "full", blocker / "cache", warnings=warnings)
    assert len(tokens) == 12 and stats.prefix_cached_tokens == 0
    assert len(warnings) == 1 and warnings[0].startswith("document cache: not saved")


def test_concurrent_savers_leave_one_good_entry(loaded, tmp_path):
    ids = prompt()[:PREFIX]
    kv = [(torch.randn(1, 2, PREFIX, 16), torch.randn(1, 2, PREFIX, 16)) for _ in range(4)]
    caches = [DocCache(tmp_path, loaded.model, SETTINGS) for _ in range(4)]
    start = threading.Barrier(4)
    done = []

    def save(c):
        start.wait()
        done.append(c.save(ids, kv))

    threads = [threading.Thread(target=save, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(d is not None for d in done)
    got = caches[0].load(ids, "cpu")
    assert got is not None and all(torch.equal(a, b) for (a, _), (b, _) in zip(got, kv, strict=True))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers
    assert len(list_entries(tmp_path)) == 1


def test_least_recently_used_entries_go_beyond_the_cap(loaded, tmp_path):
    def kv(seed):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(1, 2, 100, 16, generator=g), torch.randn(1, 2, 100, 16, generator=g))]

    probe = DocCache(tmp_path / "probe", loaded.model, SETTINGS)
    size = list_entries(probe.root) if probe.save(list(range(100)), kv(0)) else []
    one = size[0][1]
    cache = DocCache(tmp_path / "c", loaded.model, SETTINGS, max_bytes=int(2.5 * one))
    docs = [list(range(s, s + 100)) for s in (1, 2, 3)]
    cache.save(docs[0], kv(1))
    cache.save(docs[1], kv(2))
    assert cache.load(docs[0], "cpu") is not None  # docs[0] used again: docs[1] is the oldest now
    import os
    import time

    old = time.time() - 100
    os.utime(cache.root / cache.key(docs[1]) / MANIFEST, (old, old))
    cache.save(docs[2], kv(3))
    kept = {p.name for p, _, _ in list_entries(cache.root)}
    assert kept == {cache.key(docs[0]), cache.key(docs[2])}
    assert json.loads((cache.root / LENGTHS).read_text())  # the lengths index is there


def test_cli_second_run_loads_the_document(tmp_path):
    """`icecache qa` twice over the example report with --doc-cache: the second run loads the
    document's prefill (--stats says how many tokens) and answers the same; --no-doc-cache
    neither loads nor saves."""
    from tests.conftest import EXAMPLE, run_cli

    profile = tmp_path / "p.yaml"
    profile.write_text("doc_cache_min_tokens: 256\n")
    cache = tmp_path / "docs"
    args = ["qa", str(EXAMPLE), "-q", "Who wrote the report?", "--profile", str(profile),
            "--max-new-tokens", "8", "--json", "--stats", "--doc-cache", str(cache)]
    runs = [run_cli(args) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr.decode()
    stats = [json.loads(r.stderr.decode().strip().splitlines()[-1]) for r in runs]
    assert stats[0]["prefix_cached_tokens"] == 0 and stats[1]["prefix_cached_tokens"] > 256
    out = [json.loads(r.stdout) for r in runs]
    assert out[1]["output"] == out[0]["output"] and out[1]["prefix_cached_tokens"] == stats[1]["prefix_cached_tokens"]
    assert "document cache:" in runs[1].stderr.decode()
    off = run_cli([*args[:-2], "--no-doc-cache", "--doc-cache", str(tmp_path / "unused")])
    assert off.returncode == 0
    assert json.loads(off.stderr.decode().strip().splitlines()[-1])["prefix_cached_tokens"] == 0
    assert not (tmp_path / "unused").exists()


def test_cli_prefill_list_and_clear(tmp_path):
    """`icecache prefill` saves a document without generating (a second time: already cached);
    a later qa loads it; `cache list` shows the entry; `cache clear --older-than` keeps a fresh
    one, `cache clear` removes it."""
    from tests.conftest import EXAMPLE, run_cli

    profile = tmp_path / "p.yaml"
    profile.write_text("doc_cache_min_tokens: 256\n")
    cache = tmp_path / "docs"
    where = ["--profile", str(profile), "--doc-cache", str(cache)]
    rows = []
    for _ in range(2):
        r = run_cli(["prefill", str(EXAMPLE), *where, "--json"])
        assert r.returncode == 0, r.stderr.decode()
        rows.append(json.loads(r.stdout))
    assert [x["status"] for x in rows] == ["saved", "already cached"]
    r = run_cli(["qa", str(EXAMPLE), "-q", "Who wrote it?", "--max-new-tokens", "4", "--stats", "--json", *where])
    assert r.returncode == 0 and json.loads(r.stderr.decode().strip().splitlines()[-1])["prefix_cached_tokens"] > 256
    listed = run_cli(["cache", "list", "--doc-cache", str(cache), "--json"])
    entries = [json.loads(line) for line in listed.stdout.decode().splitlines()]
    assert listed.returncode == 0 and len(entries) == 1 and entries[0]["tokens"] > 256
    assert run_cli(["cache", "clear", "--doc-cache", str(cache), "--older-than", "1"]).returncode == 0
    assert len(list_entries(cache)) == 1  # used just now
    assert run_cli(["cache", "clear", "--doc-cache", str(cache)]).returncode == 0
    assert list_entries(cache) == []
    off = run_cli(["prefill", str(EXAMPLE), "--no-doc-cache"])
    assert off.returncode == 2 and b"--no-doc-cache" in off.stderr


SAVER = """
import sys, torch
from types import SimpleNamespace
from icecache.doc_cache import DocCache
from tests.test_pinned import SETTINGS, tiny_model
kv = [(torch.randn(1, 8, 4000, 256), torch.randn(1, 8, 4000, 256)) for _ in range(6)]
print("saving", flush=True)
DocCache(sys.argv[1], tiny_model(), SETTINGS).save(list(range(4000)), kv)
"""


def test_killed_saver_leaves_nothing_a_later_run_trips_on(loaded, tmp_path):
    """kill -9 during a save: no entry appears half-written; a later save and load work, and
    an old unfinished save is cleared by the next save."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    root = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(root)], cwd=REPO, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"saving"
    time.sleep(0.5)  # the save (about 400 MB) under way
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in list_entries(root):  # a visible entry is a whole one, whatever the kill interrupted
        assert DocCache(root, loaded.model, SETTINGS).load(list(range(4000)), "cpu") is not None
    for p in root.glob(".saving-*"):  # an unfinished save from long ago ...
        os.utime(p, (time.time() - 7 * 3600,) * 2)
    first, _ = run(loaded, "ice", root)
    again, stats = run(loaded, "ice", root)
    assert stats.prefix_cached_tokens == PREFIX and again == first
    assert list(root.glob(".saving-*")) == []  # ... is gone after the next save


def test_settings_added_later_join_the_identity_only_when_set(loaded, tmp_path):
    """An entry saved before a setting existed is found by a version that adds it at its
    default (the setting is left out of the identity then); set otherwise, it is its own entry."""
    from icecache.doc_cache import SHAPING_IF_SET

    run_sparse(loaded, "ice", tmp_path, {"positions": "remap"}, 40)
    (entry,) = [p for p in tmp_path.iterdir() if (p / MANIFEST).is_file()]
    saved = json.dumps(json.loads((entry / MANIFEST).read_text())["identity"])
    assert all(f'"{k}"' not in saved for k in SHAPING_IF_SET)
    _, stats, _ = run_sparse(loaded, "ice", tmp_path, {"positions": "remap", "index_refine": 1}, 40)
    assert stats.prefix_cached_tokens == 0 and len(list_entries(tmp_path)) == 2
    _, stats, _ = run_sparse(loaded, "ice", tmp_path, {"positions": "remap", "index_refine": 0}, 40)
    assert stats.prefix_cached_tokens == PREFIX


def test_refined_index_is_saved_and_restored(loaded, tmp_path, monkeypatch):
    """With ``index_refine`` the trees refine during the sparse prefill (counted here), and the
    restored state (free pages, pending keys) continues exactly as the saving run did."""
    from icecache.index import DCITree

    calls = []
    original = DCITree.refine

    def counted(self, *a, **kw):
        moved = original(self, *a, **kw)
        calls.append(moved)
        return moved

    monkeypatch.setattr(DCITree, "refine", counted)
    changes = {"index_pages": "similar", "index_merge": "mass", "index_refine": 2}
    first, _, pages1 = run_sparse(loaded, "ice", tmp_path, changes, 40)
    assert calls and sum(calls) > 0  # refinements ran and moved points
    second, s2, pages2 = run_sparse(loaded, "ice", tmp_path, changes, 40)
    assert s2.prefix_cached_tokens == PREFIX and second == first and pages2 == pages1


@pytest.mark.parametrize("method,changes", [("full", {}), pytest.param("dense", {}, marks=pytest.mark.slow),
                                            pytest.param("ice", {}, marks=pytest.mark.slow), ("ice", {"prefill": "sparse"})])
def test_a_model_with_window_layers_loads_its_saved_document_and_answers_the_same(tmp_path, method, changes):
    """Gemma 3's shape (window layers of 24 tokens, a global layer): a full prefill's entry holds
    each window layer's window, a sparse prefill's state its window layer; loaded, the run
    continues at the document's true length and answers as the run that prefilled it."""
    from tests.test_ice_cache import tiny_model as arch_model

    gemma = SimpleNamespace(model=arch_model("gemma3", 1), tokenizer=SimpleNamespace(eos_token_id=None),
                            end_ids=frozenset())
    settings = SETTINGS.replace(**changes)
    first, s1 = run(gemma, method, tmp_path, settings=settings)
    second, s2 = run(gemma, method, tmp_path, settings=settings)
    assert s1.prefix_cached_tokens == 0 and s2.prefix_cached_tokens == PREFIX
    assert second == first
