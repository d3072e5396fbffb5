"""Will a method's KV cache fit? An estimate before it starts, against the memory available.

:func:`need_bytes` estimates what a method allocates for a sequence of ``tokens`` beyond what is
already in use (the model's weights are): dense keys and values for ``full`` (plus one layer's
copy while transformers concatenates a step onto it), ``dense`` and the oracles (their growing
buffers keep 256 tokens or 1/8 spare capacity, and one layer is copied when one grows); for the
paged methods the dense layers, the resident pools, the host store and the index. ``extra``
counts copies a caller makes on top (a shared prefill's keys and values).

:func:`available_bytes` is ``MemAvailable`` of ``/proc/meminfo`` capped by the profile's
``host_memory_gib`` (on a CUDA profile, the device's free memory, capped by
``device_memory_gib`` less what the process already holds, counts for the device part;
:func:`cap_device` makes the cap hold for every allocation). ``ICECACHE_MEM_AVAILABLE_GIB`` replaces the
measured host figure: meant for tests, to force a method not to fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .config import Settings
from .errors import UsageError

ENV_AVAILABLE = "ICECACHE_MEM_AVAILABLE_GIB"
# One DCI-tree's bytes per key and KV head (transformed key, page-major, with the splits' partly
# filled pages): 0.45-0.5 KB measured (docs/ice.md); Quest's key bounds are far smaller.
INDEX_BYTES_PER_KEY = 480
# The walks' int8 copy of the keys (``index_walk_keys: int8``): a key's int8 row and its step in
# partly filled pages, 106 B measured at head_dim 64 (docs/results.md, "The walk's int8 keys").
INDEX_INT8_BYTES_PER_KEY = 106
QUEST_BYTES_PER_KEY = 2 * 4 * 64 // 16  # min and max per channel per page of 16, float32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


@dataclass(frozen=True)
class Need:
    """Bytes a method would allocate: on the compute device and in host memory."""

    device: int
    host: int

    @property
    def total(self) -> int:
        return self.device + self.host


def kv_shape(model_config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers model config."""
    layers = int(model_config.num_hidden_layers)
    heads = int(getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads)
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return layers, heads, int(head_dim)


def need_bytes(method: str, model_config, settings: Settings, tokens: int, extra: int = 0) -> Need:
    """What ``method`` allocates for ``tokens`` prompt and generated tokens (an estimate; each
    cache kind's :meth:`~icecache.methods.kinds.CacheKind.memory`)."""
    from .cache.window import window_sizes
    from .methods import get
    from .methods.kinds import KVSizes

    m = get(method)
    layers, heads, head_dim = kv_shape(model_config)
    per_token = 2 * heads * head_dim * DTYPE_BYTES[settings.dtype]  # keys and values
    # a sliding-window layer holds its window (and a chunk passing through) under every method;
    # the kinds count the global layers
    windows = window_sizes(model_config, layers)
    sizes = KVSizes(layer=per_token * tokens, grown=per_token * max(tokens + 256, tokens * 9 // 8),
                    windowed=sum(per_token * min(tokens, w + settings.chunk_size) for w in windows if w),
                    per_token=per_token, global_layers=sum(1 for w in windows if not w),
                    dense_global=sum(1 for i, w in enumerate(windows) if not w and i < settings.dense_layers),
                    heads=heads, head_dim=head_dim, tokens=tokens)
    device, host = m.cache.memory(m, sizes, settings)
    return _split(device, host + extra, settings.device != "cpu")


def _split(device: int, host: int, on_device: bool) -> Need:
    return Need(device=device, host=host) if on_device else Need(device=0, host=device + host)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(settings: Settings) -> Need:
    """Memory free for new allocations: host (and device on a CUDA profile), in bytes."""
    forced = os.environ.get(ENV_AVAILABLE)
    if forced:
        try:
            host = int(float(forced) * GIB)
        except ValueError:
            raise UsageError(f"{ENV_AVAILABLE}={forced!r} is not a number of GiB") from None
    else:
        measured = _meminfo_available()
        cap = int(settings.host_memory_gib * GIB)
        host = cap if measured is None else min(measured, cap)
    device = 0
    if settings.device != "cpu":
        import torch

        if torch.cuda.is_available():
            # what torch holds but does not use is free to it too; the profile's cap counts what
            # the process already uses (the model's weights)
            used = torch.cuda.memory_allocated()
            device = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - used
            if settings.device_memory_gib:
                device = max(0, min(device, int(settings.device_memory_gib * GIB) - used))
    return Need(device=device, host=host)


def cap_device(settings: Settings) -> float | None:
    """Hold torch's allocator on the profile's CUDA device to ``device_memory_gib`` (a 24 GiB
    profile on a larger card behaves as the smaller card: an allocation past the cap raises
    torch's out-of-memory error). Returns the fraction of the card set, or None (no cap, or not
    a CUDA profile)."""
    if not settings.device.startswith("cuda") or not settings.device_memory_gib:
        return None
    import torch

    index = torch.device(settings.device).index
    index = torch.cuda.current_device() if index is None else index
    fraction = min(1.0, settings.device_memory_gib * GIB / torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def shortfall(need: Need, have: Need) -> str | None:
    """``None`` when ``need`` fits in ``have``, else "needs X GiB, Y GiB available"."""
    if need.host > have.host:
        return f"needs {need.host / GIB:.1f} GiB, {have.host / GIB:.1f} GiB available"
    if need.device > have.device:
        return f"needs {need.device / GIB:.1f} GiB of device memory, {have.device / GIB:.1f} GiB available"
    return None


def check_fits(method: str, model_config, settings: Settings, tokens: int) -> None:
    """A one-line :class:`UsageError` when ``method``'s cache for ``tokens`` cannot fit."""
    short = shortfall(need_bytes(method, model_config, settings, tokens), available_bytes(settings))
    if short:
        hint = ("; use --method ice --prefill sparse" if method != "ice" else "; use a machine with more memory")
        raise UsageError(f"--method {method} for {tokens} tokens {short} (estimated, for its KV cache){hint}")


def return_freed() -> bool:
    """Give the heap's freed pages back to the system (glibc's ``malloc_trim``): a prefill's
    transient buffers (chunk attention, the index build) stay in the process's RSS after they
    are freed otherwise. False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
