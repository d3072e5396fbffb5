"""A document's prefill kept on disk: ask about it again without prefilling it again.

An entry holds the state of a prompt prefix (the prompt up to the end of the document, which a
summary and any question about the same document share) and a JSON manifest:

    <root>/<key>/manifest.json   format, model identity, the settings that shape the KV, the
                                 prefix's length and token hash, size and SHA-256 of the tensors
    <root>/<key>/kv.safetensors  k.0, v.0, k.1, ... (1, kv heads, tokens, head_dim), as held

``key`` hashes the model identity, those settings and the prefix's token ids, so a later prompt
finds an entry by hashing its own first tokens at each prefix length the cache holds
(``lengths.json``). Entries are written to a temporary folder and renamed into place; whatever
goes wrong (a truncated or corrupt file, another format, a read-only or full disk) costs one
warning line and a normal prefill, never the task. Least recently used entries go when the
folder outgrows its cap.

Two kinds of entry: a full prefill's keys and values (the same for every method), and a sparse
prefill's whole cache state (:mod:`icecache.cache.state`), for one method and its exact settings
(:meth:`DocCache.with_kind`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .models import cache_root, file_digest

if TYPE_CHECKING:  # torch is imported where a prefix is loaded or saved, not by `icecache cache list`
    import torch

FORMAT = 1
KV_FILE, MANIFEST = "kv.safetensors", "manifest.json"
LENGTHS = "lengths.json"
# The settings a full prefill's keys and values depend on (the method does not: every method's
# full prefill is the same computation).
SHAPING = ("dtype", "weights", "chunk_size", "rope_scaling", "positions", "device")
# Settings that a sparse prefill's saved state does not depend on: the profile's name and words,
# where the cache lives and its limits, the threads. (A copy of a profile under another file name
# re-prefilled a 100k document for 12 minutes: the name was part of the key.) The threads
# change a state only by float rounding.
# ``remap_pin_gap`` places rows only once answer passages are pinned, after the prompt's end,
# never in a saved document prefix. ``dense_until`` decides whether a run has sparse layers at
# all; a run that has them holds the same state whatever its value. ``dense_kv`` takes effect at
# the first decode step, after any prefix is saved (and a cache already converted saves nothing).
STATE_NEUTRAL = frozenset({"name", "description", "doc_cache", "doc_cache_gib", "doc_cache_min_tokens", "cpu_threads",
                           "remap_pin_gap", "dense_until", "dense_kv"})

# Settings added since the format began: they join an identity (dense or sparse) only when not
# at these defaults, so a version that adds one still finds the entries saved before it.
SHAPING_IF_SET = {"index_refine": 0, "rest_estimate": False, "observation": 32, "pq_subspaces": 8, "pq_bits": 6,
                  "lsh_bits": 8, "lsh_tables": 64, "lsh_min_hits": 2}

Warn = Callable[[str], None]


def default_root() -> Path:
    """``$ICECACHE_DOC_CACHE`` (a folder), else ``documents`` in the user cache folder."""
    env = os.environ.get("ICECACHE_DOC_CACHE")
    if env and env not in ("off", "0"):
        return Path(env)
    return cache_root() / "documents"


def for_settings(model: Any, settings: Any, warn: Warn | None = None) -> DocCache | None:
    """The document cache ``settings`` ask for (``doc_cache``: a folder, "" for the default,
    "off"), or None."""
    where = settings.doc_cache
    if where == "off" or (not where and os.environ.get("ICECACHE_DOC_CACHE") in ("off", "0")):
        return None
    root = Path(where).expanduser() if where else default_root()
    return DocCache(root, model, settings, int(settings.doc_cache_gib * 2**30), warn)


def model_identity(model: Any) -> dict:
    """What names the weights: their source (a converted GGUF's folder carries the file's
    SHA-256) and a hash of the configuration."""
    cfg = model.config.to_dict()
    blob = json.dumps(cfg, sort_keys=True, default=str).encode()
    return {"source": str(getattr(model, "name_or_path", "") or cfg.get("_name_or_path", "")),
            "config_sha256": hashlib.sha256(blob).hexdigest()[:16]}


def _prompt_identity(model: Any, settings: Any) -> dict:
    """A prompt computed in 16 bits (``prompt_compute``, as resolved on this machine) is not the
    float prompt's: it names its own entries (float entries keep their names)."""
    from .methods import prompt_half

    half = prompt_half(settings, getattr(model, "device", "cpu"))
    return {} if half is None else {"prompt_compute": str(half).removeprefix("torch.")}


def tokens_hash(ids) -> str:
    return hashlib.sha256(np.asarray(list(ids), dtype=np.int64).tobytes()).hexdigest()


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


class DocCache:
    """Saved prefixes under ``root``, at most ``max_bytes`` of them (0: no cap)."""

    def __init__(self, root: Path | str, model: Any, settings: Any, max_bytes: int = 0,
                 warn: Warn | None = None):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.warn = warn or (lambda _m: None)
        values = settings.as_dict()
        self.identity = {"format": FORMAT, **model_identity(model),
                         **{k: values[k] for k in SHAPING},
                         **{k: values[k] for k, v in SHAPING_IF_SET.items() if values[k] != v},
                         **_prompt_identity(model, settings)}
        self._ident_hash = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()

    def with_kind(self, kind: dict) -> DocCache:
        """The same folder for entries of another kind (``kind`` joins the identity: a sparse
        prefill's state depends on the method and every setting of the run)."""
        twin = DocCache.__new__(DocCache)
        twin.root, twin.max_bytes, twin.warn = self.root, self.max_bytes, self.warn
        twin.identity = {**self.identity, "kind": kind}
        twin._ident_hash = hashlib.sha256(json.dumps(twin.identity, sort_keys=True, default=str).encode()).hexdigest()
        return twin

    def key(self, ids) -> str:
        return hashlib.sha256(f"{self._ident_hash}:{len(ids)}:{tokens_hash(ids)}".encode()).hexdigest()[:32]

    # -- lookup -------------------------------------------------------------------------------
    def _lengths(self) -> list[int]:
        try:
            data = json.loads((self.root / LENGTHS).read_text())
            return sorted({int(n) for n in data.get(self._ident_hash, [])}, reverse=True)
        except (OSError, ValueError, AttributeError, TypeError):
            return []

    def find(self, ids, limit: int) -> int:
        """The longest saved prefix of ``ids`` of at most ``limit`` tokens (0: none)."""
        for n in self._lengths():
            if 0 < n <= limit and (self.root / self.key(ids[:n]) / MANIFEST).is_file():
                return n
        return 0

    def load(self, ids, device) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The saved keys and values of prefix ``ids`` (per layer; a sliding-window layer's last
        rows only), or None (with a warning and the entry removed when it exists but cannot be
        used)."""
        got = self.load_entry(ids, device, self._check_kv)
        if got is None:
            return None
        manifest, tensors = got
        return [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(manifest["layers"])]

    @staticmethod
    def _check_kv(manifest: dict, tensors: dict, ids) -> None:
        kv = [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(manifest["layers"])]
        windows = manifest.get("windows") or [0] * len(kv)
        # a sliding-window layer holds the last window - 1 tokens (transformers' cut), others all
        rows = [min(len(ids), w - 1) if w else len(ids) for w in windows]
        if any(k.shape[2] != n or v.shape[2] != n for (k, v), n in zip(kv, rows, strict=True)):
            raise ValueError("its tensors hold another number of tokens")

    def load_entry(self, ids, device, check=None, lazy: bool = False) -> tuple[dict, Mapping[str, torch.Tensor]] | None:
        """The manifest and tensors saved for prefix ``ids`` (``check(manifest, tensors, ids)``
        may reject them by raising), or None, with a warning and the entry removed when it exists
        but cannot be used. ``lazy``: the tensors as :class:`SavedTensors` (on the CPU), each
        read from the file when asked for, so that a caller copying them into its own arrays
        holds the file's bytes once rather than twice."""
        entry = self.root / self.key(ids)
        if not (entry / MANIFEST).is_file():
            return None
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
            if json.loads(json.dumps(manifest.get("identity"))) != json.loads(json.dumps(self.identity, default=str)) or manifest.get("tokens") != len(ids) \
                    or manifest.get("tokens_sha256") != tokens_hash(ids):
                raise ValueError("it was saved for another model, settings or prompt")
            path = entry / KV_FILE
            if path.stat().st_size != manifest["bytes"] or file_digest(path) != manifest["sha256"]:
                raise ValueError("its tensors do not match their checksum")
            if lazy:
                tensors = SavedTensors(path)
            else:
                from safetensors.torch import load_file

                tensors = load_file(str(path), device=str(device))
            if check is not None:
                check(manifest, tensors, ids)
        except Exception as exc:  # noqa: BLE001  (any unreadable entry is rebuilt, never fatal)
            self.warn(f"document cache: entry {entry.name} not used ({_reason(exc)}); prefilling again")
            shutil.rmtree(entry, ignore_errors=True)
            return None
        with contextlib.suppress(OSError):
            os.utime(entry / MANIFEST)  # recently used
        return manifest, tensors

    # -- saving ---------------------------------------------------------------------------------
    def save(self, ids, kv: list[tuple[torch.Tensor, torch.Tensor]], windows: list[int] | None = None) -> Path | None:
        """Save prefix ``ids`` with its per-layer keys and values (``windows``: each layer's
        sliding window, 0 for a global layer; a window layer's keys are its last rows); the
        entry's folder, or None (with a warning) when it could not be written. An entry already
        there is kept."""
        def tensors():
            out = {}
            for i, (k, v) in enumerate(kv):
                out[f"k.{i}"] = k.detach().to("cpu").contiguous()
                out[f"v.{i}"] = v.detach().to("cpu").contiguous()
            return out

        return self.save_entry(ids, tensors, {"layers": len(kv), "windows": windows or [0] * len(kv)})

    def save_entry(self, ids, tensors: Callable[[], dict], extra: dict) -> Path | None:
        """Save prefix ``ids`` with the tensors ``tensors()`` gives and ``extra`` in the manifest."""
        entry = self.root / self.key(ids)
        if (entry / MANIFEST).is_file():
            with contextlib.suppress(OSError, ValueError):
                self._add_length(len(ids))  # (a concurrent saver's list update may have lost it)
            return entry
        if entry.exists():  # a folder without its manifest is not an entry: replace it
            shutil.rmtree(entry, ignore_errors=True)
        tmp = None
        try:
            from safetensors.torch import save_file

            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_saves()
            tmp = Path(tempfile.mkdtemp(prefix=".saving-", dir=self.root))
            save_file(tensors(), str(tmp / KV_FILE))
            manifest = {"identity": self.identity, "tokens": len(ids), "tokens_sha256": tokens_hash(ids),
                        **extra, "bytes": (tmp / KV_FILE).stat().st_size,
                        "sha256": file_digest(tmp / KV_FILE), "saved": time.time()}
            with open(tmp / MANIFEST, "w") as f:  # written last: an entry without it is not read
                json.dump(manifest, f, default=str)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.rename(tmp, entry)
                tmp = None
            except OSError:
                if not (entry / MANIFEST).is_file():  # not another process's finished entry
                    raise
                # another saver's entry is in place: ours is removed below
            self._add_length(len(ids))
            self.evict(keep=entry)
            return entry
        except Exception as exc:  # noqa: BLE001  (a cache that cannot be written never fails the task)
            self.warn(f"document cache: not saved ({_reason(exc)})")
            return None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    STALE_SAVE_S = 6 * 3600  # a save this old without its rename: its process died (kill -9)

    def _remove_stale_saves(self) -> None:
        now = time.time()
        for p in self.root.glob(".saving-*"):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > self.STALE_SAVE_S:
                    shutil.rmtree(p, ignore_errors=True)

    def _add_length(self, n: int) -> None:
        path = self.root / LENGTHS
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        lengths = set(data.get(self._ident_hash, []))
        lengths.add(n)
        data[self._ident_hash] = sorted(lengths)[-64:]
        fd, tmp = tempfile.mkstemp(prefix=".lengths-", dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # atomic: a reader sees the old or the new list

    # -- the folder -------------------------------------------------------------------------------
    def entries(self) -> list[tuple[Path, int, float]]:
        """(folder, bytes, last use) of every finished entry, least recently used first."""
        return list_entries(self.root)

    def evict(self, keep: Path | None = None) -> int:
        """Remove least recently used entries until the folder fits its cap; return how many."""
        if not self.max_bytes:
            return 0
        items = self.entries()
        total = sum(b for _, b, _ in items)
        removed = 0
        for path, size, _ in items:
            if total <= self.max_bytes:
                break
            if keep is not None and path == keep:
                continue
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            removed += 1
        return removed


def list_entries(root: Path) -> list[tuple[Path, int, float]]:
    """(folder, bytes, last use) of the finished entries under ``root``, least recently used first."""
    out = []
    if not Path(root).is_dir():
        return out
    for d in Path(root).iterdir():
        m = d / MANIFEST
        if d.is_dir() and not d.name.startswith(".") and m.is_file():
            with contextlib.suppress(OSError):
                out.append((d, _dir_bytes(d), m.stat().st_mtime))
    return sorted(out, key=lambda e: e[2])


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:160]


class SavedTensors(Mapping):
    """The tensors of a safetensors file, each read from the file into a new CPU tensor when it
    is asked for and held by no one here.

    A sparse prefill's saved state is several GB (a 100k-token document of the embedded model:
    7.3 GB, most of it the index's keys); reading it whole and then copying it into the cache's
    capacity-sized arrays held both at once, the load's peak twice the state's size. Read one
    tensor at a time, the copy's source lives only while it is copied. Not safetensors'
    ``safe_open``: it maps the file, and every page read stays in the process's resident set
    while the file is open (reading that 7.3 GB state tensor by tensor: peak RSS 7.1 GiB through
    ``safe_open``, 0.4 GiB here)."""

    DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("its header runs past the file's end")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.start = 8 + n
        for name, info in header.items():
            a, b = info["data_offsets"]
            if info["dtype"] not in self.DTYPES or not 0 <= a <= b <= size - self.start:
                raise ValueError(f"its tensor {name} has an unknown type or lies outside the file")
        self.header = header

    def __getitem__(self, name: str) -> torch.Tensor:
        import torch

        info = self.header[name]
        a, b = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=getattr(torch, self.DTYPES[info["dtype"]]))
        if out.numel() * out.element_size() != b - a:
            raise ValueError(f"its tensor {name} holds {b - a} bytes for shape {info['shape']}")
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.start + a)
            done = 0
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"its tensor {name} is cut short")
                done += got
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.header)

    def __len__(self) -> int:
        return len(self.header)
