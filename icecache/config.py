"""Settings: dataclass defaults -> YAML hardware profile -> command-line flags.

One frozen :class:`Settings` object comes out of :func:`resolve_settings`; every value in it has
been type-checked and validated, and every error names the key and where it came from (a profile
file or a flag).

A profile is a flat YAML mapping whose keys are the fields of :class:`Settings` (plus ``name`` and
``description``) and the page selectors' own keys (each selector's ``Settings`` dataclass in
``icecache.cache.selectors``, e.g. ``carry_pages``, kept in :attr:`Settings.tuning`). The dataclass
defaults are the shipped values (docs/profiles.md); a profile names what its machine changes.
Shipped profiles live in ``profiles/`` (installed as ``icecache.profiles``); ``--profile`` takes
one of their names or a path to a YAML file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from .errors import ProfileError

DTYPES = ("float32", "bfloat16", "float16")
PREFILL_MODES = ("full", "sparse", "auto")
HOST_DTYPES = ("auto",) + DTYPES
HALF_CHOICES = ("model", "bfloat16", "auto")  # dense_kv, prompt_compute
CHAT_CHOICES = ("auto", "family", "plain")  # chat_template; icecache.chat.CHOICES (tested equal)
POSITIONS = ("auto", "true", "remap")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
WEIGHT_FORMATS = ("float", "int8", "int4", "auto")  # icecache.weights
DECODE_INPUTS = ("auto", "float", "int16")  # icecache.int16_inputs
MAX_THREADS = 256
# A CUDA (or ROCm) device needs its driver's device files: NVIDIA's, WSL 2's, AMD's
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


@dataclass(frozen=True)
class Settings:
    """Everything that fixes how a model runs on one machine.

    Memory sizes are in GiB; ``0`` means "not limited / not known". Token counts (``budget``,
    ``chunk_size``, ``max_context``) are in tokens; ``sink_pages`` and ``window_pages`` in pages of
    ``page_size`` tokens.
    """

    name: str = "default"
    description: str = ""
    device: str = "cpu"
    device_memory_gib: float = 0.0
    host_memory_gib: float = 16.0
    cpu_threads: int = 0  # 0: one per core
    dtype: str = "float32"
    # the linear layers' weights: "float" (the model's dtype), "int8" (one scale per output
    # channel), "int4" (groups of 32 inputs with a step and a minimum each, the LM head's int8
    # logits checked against its float weights) or "auto" (on the CPU, int4 for each layer it
    # holds exactly, as a Q4_1 GGUF's, and the checked int8 LM head; elsewhere float);
    # activations in dtype (icecache.weights.apply_weights)
    weights: str = "auto"
    # the input of a decode step's 4-bit products (the fused layers, CPU): "float" (float32), "int16"
    # (rounded per group of 32, the sums in integers; icecache.int16_inputs) or "auto" (int16 where
    # numba compiles for AVX2, whose vpmaddwd makes it the faster; else float)
    decode_inputs: str = "auto"
    page_size: int = 16
    budget: int = 256
    sink_pages: int = 2
    window_pages: int = 8
    dense_layers: int = 2
    # ice and ice-reuse: a run of at most this many tokens (prompt + generation) keeps every layer
    # dense, attending to every token (exact), where that is faster than selecting pages
    # (0: never; with a full prefill only; past the trained context only if the prompt fits it,
    # the decode steps then clamping the farthest keys' distance). icecache.methods.all_dense
    dense_until: int = 9216
    # dense layers' keys and values while decoding (ice's dense layers, every layer of a dense_until
    # run, the dense method): "model" (the model's dtype), "bfloat16", or "auto" (bfloat16 for a
    # float32 model on a CPU that multiplies bfloat16 natively); the prompt is computed in the
    # model's dtype either way
    dense_kv: str = "auto"
    # the prompt's products (the int4 layers' many-row products and the chunks' attention):
    # "model" (the model's dtype), "bfloat16" (float32 sums), or "auto" (bfloat16 for a float32
    # model on a CPU that multiplies bfloat16 natively)
    prompt_compute: str = "auto"
    # passages pinned for the answer (0: off): the prompt's last stepped tokens (up to 32) vote
    # over the offloaded tokens with every sparse layer's exact attention (a token's largest
    # head weight); the answer_spans best places (each a page before and two after, in token
    # order) stay loaded from the prompt's last step on, beside the budget's pages (remapped:
    # nearest the window)
    answer_spans: int = 3
    reuse_every: int = 3  # ice-reuse: an anchor layer queries, the next reuse_every - 1 reuse it
    chunk_size: int = 2048
    max_context: int = 262144
    # "full": chunks attend to all before them; "sparse": to selected pages; "auto": full while the
    # prompt fits the model's trained context and the memory, sparse beyond (methods that can)
    prefill: str = "auto"
    prefill_budget: int = 1024  # sparse prefill: tokens of pages each chunk selects per KV head
    tail_budget: int = 64  # sparse prefill: tokens of pages each prompt-end step selects per KV head
    # sparse prefill: the prompt-end steps' index search covers at least this share of the
    # indexed keys (1: all of them, an exact search; their pages decide the first answer token)
    tail_beam_frac: float = 1.0
    prefill_queries: int = 16  # sparse prefill: chunk positions whose queries select the pages
    dense_window: int = 4096  # sparse prefill: recent tokens the dense layers attend to
    pipeline: bool = True  # offload and index a layer in the background while the next computes
    # the paged methods' decode attention over the resident rows on a GPU: "torch" (SDPA with the
    # rows' mask), "flashinfer" (FlashInfer's paged decode kernel; needs the package and CUDA) or
    # "auto" (FlashInfer where the device is CUDA and the package is installed, else torch)
    attention_backend: str = "auto"
    host_dtype: str = "auto"  # the host store's: auto = float16 for a float32 model, else the model's
    # Positions past the trained context: "remap" gives every attended token a distance the model
    # was trained on, "true" keeps true distances, "auto" remaps when a run outgrows the context.
    positions: str = "auto"
    # remapped pages with pinned answer passages (answer_spans): the sink and the
    # selected pages sit remap_pin_gap positions farther back than the passages, which stay
    # nearest the window, the best voted nearest (0: right behind them, in token order), as far
    # as the trained context allows; unless the best passage continues the sink (then nothing
    # moves). Well-voted rows next to a passage join it. Fragments of the budget's pages just
    # before the question read as the text it follows; farther back, as earlier text
    remap_pin_gap: int = 2048
    # RoPE scaling for runs that outgrow the trained context (icecache.rope): none, linear,
    # dynamic or yarn; with one set, positions stay true (the scaling handles them).
    rope_scaling: str = "none"
    # the prompts' form for a model file without a chat template (icecache.chat): "auto" (plain
    # text; the model's own template where it has one), "family" (its family's template: Gemma,
    # Llama 3, ChatML, Mistral) or "plain" (plain text even where it has one)
    chat_template: str = "auto"
    # The document cache (icecache.doc_cache): a document's prefill saved on disk and loaded by
    # a later run over the same document. doc_cache: a folder, "" (the user cache folder, or
    # $ICECACHE_DOC_CACHE) or "off"; used from doc_cache_min_tokens of shared prompt prefix;
    # least recently used entries go beyond doc_cache_gib.
    doc_cache: str = ""
    doc_cache_gib: float = 10.0
    doc_cache_min_tokens: int = 2048
    # the page selectors' keys a profile, flag or variant set, sorted ((key, value), ...); the
    # others keep their selector's default (:func:`selector_settings`)
    tuning: tuple = ()

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (fields or selector keys; unchecked: :func:`apply` checks)."""
        tuned = {k: changes.pop(k) for k in list(changes) if k not in FIELD_TYPES and k != "tuning"}
        unknown = set(tuned) - set(selector_keys()) if tuned else set()
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        if tuned:
            changes["tuning"] = tuple(sorted((dict(changes.get("tuning", self.tuning)) | tuned).items()))
        return dataclasses.replace(self, **changes)

    def tuned(self, key: str) -> Any:
        """A selector key's value: as set, else its selector's default."""
        return dict(self.tuning).get(key, selector_keys()[key][1])

    def as_dict(self) -> dict[str, Any]:
        """Every setting by its profile key, the selectors' keys with their values in effect."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tuning"}
        return out | {key: default for key, (_t, default) in selector_keys().items()} | dict(self.tuning)

    @property
    def budget_pages(self) -> int:
        return self.budget // self.page_size


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
FIELD_TYPES: dict[str, type] = {f.name: _TYPES[str(f.type)] for f in fields(Settings) if f.name != "tuning"}


def selector_keys() -> dict[str, tuple[type, Any]]:
    """The page selectors' keys: key -> (type, default) (``icecache.cache.selectors``)."""
    from .cache.selectors.base import tunable

    return tunable()


def selector_settings(settings: Settings, name: str) -> Any:
    """Selector ``name``'s settings dataclass under ``settings``."""
    from .cache.selectors import settings_for

    return settings_for(name, dict(settings.tuning))


def _where(source: str, key: str) -> str:
    """How an error names its origin: the flag itself, or the file and key."""
    return source if source.startswith("--") else f"{source}: key '{key}'"


def _check_type(key: str, value: Any, source: str, want: type) -> Any:
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is bool and isinstance(value, bool):
        return value
    if key == "positions" and value is True:
        return "true"  # YAML reads an unquoted `positions: true` as a boolean
    if isinstance(value, bool) or not isinstance(value, want):
        raise ProfileError(f"{_where(source, key)} must be {want.__name__}, got {type(value).__name__} {value!r}")
    return value


def validate(s: Settings, source: str) -> Settings:
    """Check values that are each well-typed but impossible alone or together."""

    def bad(key: str, why: str) -> ProfileError:
        return ProfileError(f"{_where(source, key)} {why}, got {getattr(s, key)!r}")

    if not re.fullmatch(r"cpu|cuda(:\d+)?", s.device):
        raise bad("device", "must be 'cpu', 'cuda' or 'cuda:N'")
    if s.dtype not in DTYPES:
        raise bad("dtype", f"must be one of {', '.join(DTYPES)}")
    if s.weights not in WEIGHT_FORMATS:
        raise bad("weights", f"must be one of {', '.join(WEIGHT_FORMATS)}")
    if s.decode_inputs not in DECODE_INPUTS:
        raise bad("decode_inputs", f"must be one of {', '.join(DECODE_INPUTS)}")
    if s.weights not in ("float", "auto") and s.device != "cpu":
        raise bad("weights", "other than float run on the CPU only (GPU profiles keep the model's dtype)")
    if s.device_memory_gib < 0:
        raise bad("device_memory_gib", "must be >= 0")
    if s.host_memory_gib <= 0:
        raise bad("host_memory_gib", "must be > 0")
    if not 0 <= s.cpu_threads <= MAX_THREADS:
        raise bad("cpu_threads", f"must be between 0 (one per core) and {MAX_THREADS}")
    if s.page_size <= 0 or s.page_size & (s.page_size - 1) or s.page_size > 1024:
        raise bad("page_size", "must be a power of two between 1 and 1024")
    if s.budget <= 0 or s.budget % s.page_size:
        raise bad("budget", f"must be a positive multiple of page_size ({s.page_size})")
    if s.sink_pages < 0:
        raise bad("sink_pages", "must be >= 0")
    if s.window_pages < 1:
        raise bad("window_pages", "must be >= 1")
    if s.dense_layers < 0:
        raise bad("dense_layers", "must be >= 0")
    if not 0 <= s.dense_until <= 1_048_576:
        raise bad("dense_until", "must be between 0 and 1048576")
    if not 0 <= s.answer_spans <= 16:
        raise bad("answer_spans", "must be a whole number from 0 (off) to 16")
    if s.reuse_every < 1:
        raise bad("reuse_every", "must be >= 1")
    if s.chunk_size <= 0 or s.chunk_size % s.page_size:
        raise bad("chunk_size", f"must be a positive multiple of page_size ({s.page_size})")
    if s.attention_backend not in ATTENTION_BACKENDS:
        raise bad("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}")
    if s.attention_backend == "flashinfer" and s.device == "cpu":
        raise bad("attention_backend", "flashinfer runs on a CUDA device only (device: cpu)")
    if s.prefill not in PREFILL_MODES:
        raise bad("prefill", f"must be one of {', '.join(PREFILL_MODES)}")
    if s.prefill_budget <= 0 or s.prefill_budget % s.page_size:
        raise bad("prefill_budget", f"must be a positive multiple of page_size ({s.page_size})")
    if s.tail_budget <= 0 or s.tail_budget % s.page_size:
        raise bad("tail_budget", f"must be a positive multiple of page_size ({s.page_size})")
    if not 0 <= s.tail_beam_frac <= 1:
        raise bad("tail_beam_frac", "must be in [0, 1]")
    if s.prefill_queries < 1:
        raise bad("prefill_queries", "must be >= 1")
    if s.dense_window <= 0:
        raise bad("dense_window", "must be > 0")
    if not 0 <= s.remap_pin_gap <= 1_048_576:
        raise bad("remap_pin_gap", "must be between 0 and 1048576")
    if s.positions not in POSITIONS:
        raise bad("positions", f"must be one of {', '.join(POSITIONS)}")
    from .rope import SCALINGS

    if s.chat_template not in CHAT_CHOICES:
        raise bad("chat_template", f"must be one of {', '.join(CHAT_CHOICES)}")
    if s.rope_scaling not in SCALINGS:
        raise bad("rope_scaling", f"must be one of {', '.join(SCALINGS)}")
    if s.rope_scaling != "none" and s.positions == "remap":
        raise bad("rope_scaling", "and positions: remap exclude each other (remap keeps the model's own RoPE)")
    if s.doc_cache_gib < 0:
        raise bad("doc_cache_gib", "must be >= 0 (0: no cap)")
    if s.doc_cache_min_tokens < 1:
        raise bad("doc_cache_min_tokens", "must be >= 1")
    for key in ("dense_kv", "prompt_compute"):
        if getattr(s, key) not in HALF_CHOICES:
            raise bad(key, f"must be one of {', '.join(HALF_CHOICES)}")
    if s.host_dtype not in HOST_DTYPES:
        raise bad("host_dtype", f"must be one of {', '.join(HOST_DTYPES)}")
    edges = (s.sink_pages + s.window_pages) * s.page_size
    if s.max_context < edges + s.budget:
        if source != "--budget":
            raise bad("max_context", f"must hold at least sink + window + budget ({edges + s.budget} tokens)")
        raise bad("budget", f"must leave room for the sink and window pages ({edges} tokens) within "
                            f"max_context ({s.max_context} tokens): at most {s.max_context - edges}")
    return s


def apply(base: Settings, values: Mapping[str, Any], source: str) -> Settings:
    """Overlay ``values`` (a profile mapping or flags) on ``base``; check types and values."""
    changes, tuning = {}, dict(base.tuning)
    for key, value in values.items():
        if key in FIELD_TYPES:
            changes[key] = _check_type(key, value, source, FIELD_TYPES[key])
            continue
        tunable = selector_keys()
        if key not in tunable:
            known = sorted(FIELD_TYPES) + sorted(tunable)
            raise ProfileError(f"{source}: unknown key '{key}' (known keys: {', '.join(known)})")
        tuning[key] = _check_type(key, value, source, tunable[key][0])
        _check_selectors(key, tuning, source)
    if tuning:
        changes["tuning"] = tuple(sorted(tuning.items()))
    return validate(base.replace(**changes), source)


def _check_selectors(key: str, tuning: dict[str, Any], source: str) -> None:
    """Build each selector's settings that ``key`` belongs to: a value it refuses names the key."""
    import dataclasses as dc

    from .cache.selectors import SELECTORS, settings_for

    for name, cls in SELECTORS.items():
        if key in {f.name for f in dc.fields(cls.Settings)}:
            try:
                settings_for(name, tuning)
            except ValueError as exc:
                why = str(exc).removeprefix(key).strip()
                raise ProfileError(f"{_where(source, key)} {why}, got {tuning[key]!r}") from None


def profiles_dir() -> Path:
    """The folder of shipped profiles: ``profiles/`` in a checkout, else the installed copy."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "profiles"
    if checkout.is_dir():
        return checkout
    spec = importlib.util.find_spec("icecache.profiles")
    if spec and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    raise ProfileError("the shipped profiles folder is missing; reinstall icecache")


def shipped_profiles() -> dict[str, Path]:
    return {p.stem: p for p in sorted(profiles_dir().glob("*.yaml"))}


def profile_path(name_or_path: str) -> Path:
    """Resolve ``--profile``: a shipped profile name or a path to a YAML file."""
    shipped = shipped_profiles()
    if name_or_path in shipped:
        return shipped[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path or path.exists():
        if not path.is_file():
            raise ProfileError(f"profile file {name_or_path} does not exist")
        return path
    raise ProfileError(
        f"unknown profile '{name_or_path}' (shipped: {', '.join(shipped)}; or pass a YAML path)"
    )


def load_profile(name_or_path: str, base: Settings | None = None) -> Settings:
    path = profile_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile {path}: cannot be read ({exc.__class__.__name__})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ProfileError(f"profile {path}: not valid YAML{where}") from None
    if data is None or data == {}:
        raise ProfileError(f"profile {path}: is empty (a mapping of settings is expected; see `icecache profiles`)")
    if not isinstance(data, dict):
        raise ProfileError(f"profile {path}: must be a mapping of keys to values")
    data.setdefault("name", path.stem)
    return apply(base or Settings(), data, f"profile {path}")


def default_profile_name() -> str:
    """``cpu`` without CUDA; with CUDA, the shipped GPU profile that fits the device's memory.
    Without a GPU driver's device files (NVIDIA's, WSL's, ROCm's) torch is not asked: importing it
    takes seconds, and a bad input or ``--help`` should answer at once."""
    if not any(os.path.exists(p) for p in GPU_DEVICE_FILES):
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return "h100-80gb" if gib >= 60 else "a100-40gb" if gib >= 32 else "rtx4090-24gb"


def resolve_settings(profile: str | None = None, **flags: Any) -> Settings:
    """Defaults -> profile -> flags (flags that are ``None`` are left out)."""
    settings = load_profile(profile or default_profile_name())
    given = {k: v for k, v in flags.items() if v is not None}
    if given:
        # Errors from flags name the flag, not the profile file.
        for key, value in given.items():
            settings = apply(settings, {key: value}, f"--{key.replace('_', '-')}")
    return settings
