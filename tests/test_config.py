"""Profiles and settings: defaults -> profile -> flags, and one clear error per kind of mistake."""

from __future__ import annotations

import pytest

from icecache.config import Settings, load_profile, resolve_settings, shipped_profiles
from icecache.errors import ProfileError

from .conftest import run_cli


def test_shipped_profiles_exist_and_validate():
    names = set(shipped_profiles())
    assert {"cpu", "a100-40gb", "h100-80gb", "rtx4090-24gb"} <= names
    for name in names:
        s = load_profile(name)
        assert s.name == name
        assert s.budget % s.page_size == 0


def test_cpu_profile_values():
    s = load_profile("cpu")
    assert (s.device, s.dtype, s.page_size, s.budget) == ("cpu", "float32", 16, 256)
    assert load_profile("h100-80gb").device == "cuda"


def test_order_defaults_then_profile_then_flags(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("budget: 128\nchunk_size: 512\n")
    s = resolve_settings(str(p))
    assert s.budget == 128 and s.chunk_size == 512  # from the profile
    assert s.window_pages == Settings().window_pages  # from the defaults
    assert s.name == "mine"
    s = resolve_settings(str(p), budget=64, chunk_size=None)
    assert s.budget == 64 and s.chunk_size == 512  # flag wins; a None flag is left out


BAD_PROFILES = [
    ("budgt: 256\n", "unknown key 'budgt'"),
    ("budget: '256'\n", "key 'budget' must be int, got str"),
    ("budget: true\n", "key 'budget' must be int, got bool"),
    ("dtype: 16\n", "key 'dtype' must be str"),
    ("budget: 100\n", "key 'budget' must be a positive multiple of page_size (16)"),
    ("budget: 0\n", "key 'budget' must be a positive multiple"),
    ("page_size: 12\nbudget: 24\nchunk_size: 48\n", "key 'page_size' must be a power of two"),
    ("cpu_threads: 5000\n", "key 'cpu_threads' must be between 0"),
    ("cpu_threads: -1\n", "key 'cpu_threads' must be between 0"),
    ("window_pages: 0\n", "key 'window_pages' must be >= 1"),
    ("index_pages: kmeans\n", "key 'index_pages' must be 'projection' or 'similar'"),
    ("index_merge: sum\n", "key 'index_merge' must be one of ranks, mass, peaks"),
    ("index_walk_keys: int4\n", "key 'index_walk_keys' must be one of float32, int8"),
    ("tail_budget: 24\n", "key 'tail_budget' must be a positive multiple of page_size (16)"),
    ("device: tpu\n", "key 'device' must be 'cpu', 'cuda' or 'cuda:N'"),
    ("dtype: int8\n", "key 'dtype' must be one of float32"),
    ("host_dtype: int8\n", "key 'host_dtype' must be one of auto, float32"),
    ("decode_inputs: int8\n", "key 'decode_inputs' must be one of auto, float, int16"),
    ("host_memory_gib: 0\n", "key 'host_memory_gib' must be > 0"),
    ("chunk_size: 100\n", "key 'chunk_size' must be a positive multiple of page_size"),
    ("max_context: 300\n", "key 'max_context' must hold at least sink + window + budget (416 tokens)"),
    ("- a\n- b\n", "must be a mapping"),
    ("budget: [1\n", "not valid YAML at line"),
]


@pytest.mark.parametrize("text,message", BAD_PROFILES)
def test_bad_profile_is_one_clear_error_naming_key_and_file(tmp_path, text, message):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ProfileError) as info:
        load_profile(str(p))
    assert message in str(info.value)
    assert str(p) in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_profile_name_and_missing_file():
    with pytest.raises(ProfileError, match="unknown profile 'nope'.*cpu"):
        load_profile("nope")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile("/no/such/profile.yaml")


def test_flag_errors_name_the_flag():
    with pytest.raises(ProfileError, match=r"^--budget must be a positive multiple of page_size \(16\), got 40$"):
        resolve_settings("cpu", budget=40)


def test_profiles_command_lists_and_rejects(tmp_path):
    r = run_cli(["profiles"])
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    for name in ("cpu", "a100-40gb", "h100-80gb", "rtx4090-24gb"):
        assert name in out
    assert "budget" in out and "page_size" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("budget: 100\n")
    r = run_cli(["profiles", str(bad)])
    assert r.returncode == 2
    assert r.stdout == b""
    err = r.stderr.decode()
    assert err.count("\n") == 1 and str(bad) in err and "'budget'" in err


def test_positions_true_unquoted_in_yaml(tmp_path):
    """YAML reads `positions: true` as a boolean: it means the mode "true"; other values are checked."""
    from icecache.config import load_profile
    from icecache.errors import ProfileError

    p = tmp_path / "p.yaml"
    p.write_text("positions: true\n")
    assert load_profile(str(p)).positions == "true"
    p.write_text("positions: sometimes\n")
    with pytest.raises(ProfileError, match="positions"):
        load_profile(str(p))
