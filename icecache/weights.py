"""Weight formats for the model's linear layers (the ``weights`` setting).

``float``: the model's own dtype (nothing changes). ``int8``: weight-only quantization with one
float scale per output channel (symmetric, round to nearest); activations stay in the model's
dtype outside the layer. A decode step multiplies one row by every weight matrix, so it is bound
by reading the weights: int8 reads a quarter of float32's bytes. The product is torch's own CPU
kernel (``aten._weight_int8pack_mm``); for many rows at once (a prefill chunk) the matrix is
widened to bfloat16, block by block of output channels, and multiplied as usual, where a dense
product beats the weight-only kernel.

:func:`dequantized` is the plain reference the tests compare :class:`Int8Linear` with.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import WEIGHT_FORMATS

# The products run in bfloat16 (float32 accumulation inside the kernels): torch's int8 kernel is
# fast with bfloat16 activations only (with float32 ones it was 5x slower than float32 weights on
# this CPU), and a bfloat16 product of many rows uses the CPU's bfloat16 instructions (2.5x
# float32's speed here: docs/results.md, session 11). The layer's input and output keep the
# model's dtype.
COMPUTE = torch.bfloat16

# Up to this many rows the weight-only kernel runs; above it, the widened product (measured at
# 1 row and at 2048: the kernel wins the first, the widened product the second; the crossover
# between them was not measured).
ROWS_INT8_KERNEL = 16
# Output channels widened at a time in the many-row product (bounds the temporary to this many
# rows of the weight in bfloat16).
WIDEN_BLOCK = 4096


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per row) with ``weight ~= q * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix an int8 weight stands for (the reference)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and a scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_rows(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("scale_c", scale.to(COMPUTE), persistent=False)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.act_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xc = x.reshape(-1, shape[-1]).to(COMPUTE).contiguous()
        if xc.shape[0] <= ROWS_INT8_KERNEL:
            y = torch.ops.aten._weight_int8pack_mm(xc, self.qweight, self.scale_c)
        else:
            y = torch.empty(xc.shape[0], self.out_features, dtype=COMPUTE, device=xc.device)
            for lo in range(0, self.out_features, WIDEN_BLOCK):
                hi = min(self.out_features, lo + WIDEN_BLOCK)
                w = dequantized(self.qweight[lo:hi], self.scale[lo:hi], COMPUTE)
                torch.matmul(xc, w.T, out=y[:, lo:hi])
        y = y.to(self.act_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_model(model: nn.Module, fmt: str) -> int:
    """Replace the linear layers of ``model`` (the LM head included) in format ``fmt``; returns
    how many were replaced. ``float`` leaves the model as it is."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format '{fmt}' (known: {', '.join(WEIGHT_FORMATS)})")
    if fmt == "float":
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(mod))
    return len(targets)
