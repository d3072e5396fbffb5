"""A GGUF file's quantized linear layers, packed for a decode step from the file's own blocks
(``weights: auto`` on the CPU, :func:`~icecache.weights.apply_weights`).

transformers loads a GGUF by dequantizing every tensor to float, so a Q5_0 or Q8_0 layer decodes
from float32: four bytes a weight where the file spends one or less. Here the file's blocks are
read again and each layer becomes its blocks' integers ``u`` (``w = u * step + low``, ``u`` in
0..2**bits - 1) held as one byte a weight (two a byte where every ``u`` is under 16: Q4_0, Q4_1,
Q4_K), with a step and a minimum per group of 32 inputs
(:class:`GroupedLinear`, through :func:`~icecache.int8_rows.grouped_product`). Exact: Q4_0,
Q4_1, Q4_K (a sub-block of 32 has its own step ``d * scale`` and minimum ``-dmin * min``), Q5_0,
Q5_1, Q5_K, Q8_0. Q6_K's sub-blocks are 16 inputs with their own scales, which groups of 32 cannot
hold: it becomes eight bits rounded from its float values (the nearest form in groups of 32; its
agreement is measured, not exact). Every other format (F16, Q2_K, Q3_K, the IQ kinds) stays as
transformers loaded it.

Why a byte a weight and not torch's four-bit kernel: a byte holds every format up to eight bits
in one product (the four-bit kernel needed two sets of rows, "planes", for five- and eight-bit
formats), and on a 2-core AVX2 CPU a 3072 x 576 product of bytes took 88 us where the four-bit
kernel took 200 us for one plane. Gemma 3 then decoded at 46-70 ms a token where the planes (and
torch's int8 head) took 85-100 (docs/results.md, "Weights" and "Beside llama.cpp").

A layer is packed only where its bytes give back transformers' float weight exactly (or, for
Q6_K, within half a step of eight bits): the file's tensor names are mapped to the model's by
gguf's tensor-name map (the one transformers loads with), in transformers' row order (Llama's q/k
rows are permuted on load), and any layer that does not come back the same stays float. The block layouts are ggml's (``ggml-common.h``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import int8_rows
from .weights import GROUP, ROWS_INT8_KERNEL, in_prompt, int4_fits, prompt_product

EXACT = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0")
NEAREST = ("Q6_K",)


@dataclass
class Blocks:
    """One tensor's values as ``u * step + low``: ``u`` (rows, cols) integers in 0..2**bits - 1,
    ``step`` and ``low`` float32 (rows, cols // 32), one per group of 32 inputs."""

    u: np.ndarray
    step: np.ndarray
    low: np.ndarray
    bits: int


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 (blocks, 1)."""
    return raw[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-input block's 16 bytes: inputs 0..15 in the low nibbles, 16..31 in the high ones."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's four bytes of high bits (a little-endian word, bit j for input j) -> (blocks, 32)."""
    word = qh.copy().view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's twelve bytes -> (scale, minimum) of its 8 sub-blocks, six bits
    each: the first four in the low six bits of bytes 0..3 and 4..7, the last four in the nibbles
    of bytes 8..11 with their top two bits in the top bits of bytes 0..7."""
    sc = sc.astype(np.uint8)
    scale = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)
    low = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    return scale.astype(np.float32), low.astype(np.float32)


def _k_values(qs: np.ndarray) -> np.ndarray:
    """A K-quant super-block's 128 bytes of nibbles -> its 256 four-bit values: each 32 bytes hold
    64 inputs, the first 32 in the low nibbles, the next 32 in the high ones."""
    parts = []
    for c in range(4):
        chunk = qs[:, 32 * c : 32 * c + 32]
        parts += [chunk & 0xF, chunk >> 4]
    return np.concatenate(parts, axis=1)


def decode(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One format's blocks (blocks, bytes) -> (u (blocks, inputs), step, low (blocks, groups),
    bits): the values are ``u * step + low`` group by group of 32."""
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _half(raw, 0)
        offset = 4 if kind.endswith("_1") else 2
        low = _half(raw, 2) if kind.endswith("_1") else -(8.0 if kind.startswith("Q4") else 16.0) * d
        if kind.startswith("Q5"):
            u = _nibbles(raw[:, offset + 4 :]) | (_fifth_bits(raw[:, offset : offset + 4]) << 4)
            return u, d, low, 5
        return _nibbles(raw[:, offset:]), d, low, 4
    if kind == "Q8_0":
        d = _half(raw, 0)
        u = (raw[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return u, d, -128.0 * d, 8
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _half(raw, 0), _half(raw, 2)
        scale, mins = _k_scales(raw[:, 4:16])
        step, low = d * scale, -(dmin * mins)
        if kind == "Q4_K":
            return _k_values(raw[:, 16:144]), step, low, 4
        qh = raw[:, 16:48]  # bit 2c and 2c + 1 of byte l: the fifth bits of input l of chunk c's halves
        high = np.concatenate([(qh >> j) & 1 for j in range(8)], axis=1)
        return _k_values(raw[:, 48:176]) | (high << 4), step, low, 5
    raise ValueError(f"no exact bytes for {kind}")


def blocks_of(kind: str, raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """A GGUF tensor's raw bytes (rows, bytes per row) in format ``kind`` -> :class:`Blocks`."""
    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176}[kind]
    flat = np.ascontiguousarray(raw).reshape(-1, size)
    u, step, low, bits = decode(kind, flat)
    groups = cols // GROUP
    return Blocks(u.reshape(rows, cols), step.reshape(rows, groups), low.reshape(rows, groups), bits)


def nearest_blocks(weight: torch.Tensor, bits: int = 8) -> Blocks:
    """``weight`` rounded to ``bits`` bits in groups of 32 (each with its own step and minimum)."""
    w = weight.detach().float().numpy()
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP)
    low, high = wg.min(-1), wg.max(-1)
    step = (high - low) / (2 ** bits - 1)
    step = np.where(step > 0, step, 1.0).astype(np.float32)
    u = np.clip(np.rint((wg - low[..., None]) / step[..., None]), 0, 2 ** bits - 1).astype(np.uint8)
    return Blocks(u.reshape(n, k), step, low.astype(np.float32), bits)


def widened(b: Blocks) -> torch.Tensor:
    """The float32 matrix ``b`` stands for (the reference)."""
    n, k = b.u.shape
    w = b.u.reshape(n, k // GROUP, GROUP).astype(np.float32) * b.step[..., None] + b.low[..., None]
    return torch.from_numpy(w.reshape(n, k))


class GroupedLinear(nn.Module):
    """A linear layer as its file's blocks: a byte ``u`` a weight with a step and minimum per group
    of 32 inputs (:class:`Blocks`), in :mod:`~icecache.int8_rows`' tiles; a decode step's rows
    through :func:`~icecache.int8_rows.grouped_product` (the input in float32), many rows (a
    prompt) through the layer's own float weight."""

    def __init__(self, linear: nn.Linear, b: Blocks, source: str):
        super().__init__()
        n, k = b.u.shape
        self.in_features, self.out_features, self.form, self.bits = k, n, source, b.bits
        tiles, tables = int8_rows.tile_groups(b.u.astype(np.uint8), b.step, b.low)
        self.register_buffer("tiles", torch.from_numpy(tiles), persistent=False)
        self.register_buffer("tables", torch.from_numpy(tables), persistent=False)
        self.register_buffer("widened", linear.weight.detach(), persistent=False)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.act_dtype = linear.weight.dtype
        self._half_weights: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] > ROWS_INT8_KERNEL or in_prompt():
            return prompt_product(self, x)
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        tiles, tables = self.tiles.numpy(), self.tables.numpy()
        for r in range(rows.shape[0]):
            int8_rows.grouped_product(tiles, tables, rows[r].detach().float().contiguous().numpy(), out[r].numpy())
        if self.bias is not None:
            out += self.bias.float()
        return out.to(self.act_dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        held = "two 4-bit values a byte" if self.tiles.shape[1] < self.in_features else "a byte a weight"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.form} as {held} in groups of {GROUP}"


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """How transformers reorders a tensor's rows on load (its processor's change to a column of
    row numbers), or None where the change is not a reordering of rows."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    try:
        moved = np.asarray(processor.process(weights=index, name=name, tensor_key_mapping={},
                                             parsed_parameters={}).weights)
    except Exception:  # a processor that needs more than rows: the layer stays float
        return None
    order = moved.reshape(-1)
    if moved.shape != index.shape or not np.array_equal(np.sort(order), index[:, 0]):
        return None
    return order.astype(np.int64)


# GGUF metadata value types (the GGUF spec): fixed sizes in bytes; 8 is a string, 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class Tensor:
    name: str
    kind: str  # the ggml type's name: Q4_K, F32, ...
    raw: np.ndarray  # its bytes, (rows, bytes per row), read from the file's memory map


def read_tensors(path: str | Path) -> tuple[str, list[Tensor]]:
    """(architecture, tensors) of a GGUF file, read from its header. The metadata is skipped
    value by value (a 262k-token vocabulary parsed whole took a minute); only the architecture and
    the data's alignment are kept."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(str(path), dtype=np.uint8, mode="r")
    view = memoryview(data)
    at = 0

    def take(fmt: str) -> int:
        nonlocal at
        (value,) = struct.unpack_from(fmt, view, at)
        at += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal at
        n = int(take("<Q"))
        at += n
        return bytes(data[at - n : at]).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal at
        if kind == 8:
            n = int(take("<Q"))  # read before the sum: ``at += take()`` would lose take's step
            at += n
        elif kind == 9:
            inner, count = int(take("<I")), int(take("<Q"))
            if inner in _SIZES:
                at += _SIZES[inner] * count
            else:
                for _ in range(count):
                    skip(inner)
        else:
            at += _SIZES[kind]

    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    at = 4
    take("<I")  # version
    n_tensors, n_kv = int(take("<Q")), int(take("<Q"))
    arch, align = "", 32
    for _ in range(n_kv):
        key, kind = string(), int(take("<I"))
        if key == "general.architecture" and kind == 8:
            arch = string()
        elif key == "general.alignment" and kind == 4:
            align = int(take("<I"))
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name, dims = string(), int(take("<I"))
        shape = [int(take("<Q")) for _ in range(dims)]
        infos.append((name, shape, int(take("<I")), int(take("<Q"))))
    start = -(-at // align) * align
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
            per_block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):  # a format newer than this gguf package: left as loaded
            continue
        cols, rows = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
        row_bytes = cols // per_block * block_bytes
        raw = data[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(Tensor(name, qtype.name, raw))
    return arch, tensors


def _model_names(arch: str, model: nn.Module) -> dict[str, str]:
    """GGUF tensor name -> the model's module name, for its linear layers (gguf's own name map,
    the one transformers loads with)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    found = [key for key, value in MODEL_ARCH_NAMES.items() if value == arch]
    if not found:
        return {}
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    table = get_tensor_name_map(found[0], layers)
    names = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            gguf_name = table.get_name(name) or table.get_name(name.partition(".")[2])
            if gguf_name:
                names[gguf_name + ".weight"] = name
    return names


def gguf_layers(path: str | Path, model: nn.Module, names: set[str]) -> dict[str, GroupedLinear]:
    """The layers of ``model`` named in ``names`` that the GGUF file at ``path`` stores in a format
    held in bytes (:data:`EXACT`, :data:`NEAREST`), packed, by module name; each one checked against
    the model's float weight."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch, tensors = read_tensors(path)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    to_model = _model_names(arch, model)
    layers = {}
    for tensor in tensors:
        mod_name = to_model.get(tensor.name)
        if mod_name not in names or tensor.kind not in EXACT + NEAREST:
            continue
        linear = model.get_submodule(mod_name)
        if not int4_fits(linear):
            continue
        weight = linear.weight.detach()
        if tensor.kind in NEAREST:
            b = nearest_blocks(weight)
            err = (widened(b) - weight.float()).abs().reshape(weight.shape[0], -1, GROUP)
            ok = bool((err <= torch.from_numpy(b.step)[..., None] * 0.5 + 1e-6).all())
        else:
            b = blocks_of(tensor.kind, tensor.raw, linear.out_features, linear.in_features)
            order = _row_order(processor, tensor.name, linear.out_features)
            if order is None:
                continue
            b = Blocks(b.u[order], b.step[order], b.low[order], b.bits)
            # exact: the same float32 values transformers made of the same blocks
            ok = torch.equal(widened(b).to(weight.dtype), weight)
        if ok:
            layers[mod_name] = GroupedLinear(linear, b, tensor.kind)
    return layers
