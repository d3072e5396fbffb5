"""The bandwidth floor of a decode step: the bytes of weights one token reads, at the memory read
speed measured in the same run (``icecache bench`` prints it, and each TPOT as a multiple of it).

A decode step multiplies one row by every weight matrix, so however fast its arithmetic, it
cannot take less than the time to read those weights once. The floor leaves out the KV cache (a
few MB at short contexts) and the embedding (one row), so it is a lower bound. The read speed is
a sum over a buffer far larger than the CPU's caches, with the threads torch uses, best of a few
passes (the first one warms the pages).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

# bytes the read-speed probe sums: past any L3 cache of this machine class (32 MiB)
PROBE_BYTES = 256 << 20
PROBE_PASSES = 5


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step of ``model`` reads: each linear layer's stored form (a
    packed layer's packed values and tables, the checked head's int8 rows with their scales and
    bounds, a float layer's matrix) and biases."""
    from ..head import CheckedHead

    total = 0
    for mod in model.modules():
        if isinstance(mod, CheckedHead):
            tensors = [mod.qweight, mod.scale, mod.row_bound, mod.bias]
            total += 0 if mod.tiles is None else mod.tiles.nbytes
        elif isinstance(mod, nn.Linear):
            tensors = [mod.weight, mod.bias]
        elif getattr(mod, "form", None) is not None:  # a packed layer (its buffers are what it reads)
            tensors = [buf for name, buf in mod.named_buffers(recurse=False)
                       if name not in ("widened",)]  # the float copy serves prompts only
        else:
            continue
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def read_speed(nbytes: int = PROBE_BYTES, passes: int = PROBE_PASSES) -> float:
    """Memory read speed in bytes/s: the best of ``passes`` sums over ``nbytes`` of float32."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - t)
    return nbytes / best


@dataclass
class Floor:
    weight_bytes: int
    read_bytes_per_s: float

    @property
    def ms(self) -> float:
        return 1000 * self.weight_bytes / self.read_bytes_per_s

    def as_dict(self) -> dict:
        return {**asdict(self), "floor_ms": self.ms}

    def line(self) -> str:
        return (f"bandwidth floor: {self.weight_bytes / 1e6:.1f} MB of weights a token at "
                f"{self.read_bytes_per_s / 1e9:.1f} GB/s read (measured now) = {self.ms:.2f} ms a token")


def measure(model: nn.Module) -> Floor:
    return Floor(weight_bytes(model), read_speed())
