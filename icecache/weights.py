"""Weight formats for the model's linear layers (the ``weights`` setting).

``float``: the model's own dtype (nothing changes). ``int8``: weight-only quantization with one
float scale per output channel (symmetric, round to nearest), the LM head included. ``int4``:
four-bit values in groups of 32 inputs, each group with its own scale and minimum (asymmetric,
round to nearest); the LM head becomes a :class:`~icecache.head.CheckedHead` (int8 logits, the
tokens that could be the largest recomputed from the float weights). ``auto``
(:func:`apply_weights`): on the CPU, int4 for each layer it holds exactly, a GGUF's other
quantized layers packed from the file's blocks (:mod:`icecache.gguf_weights`), the rest as they
are. Activations stay in the model's dtype outside the layers.

A decode step multiplies one row by every weight matrix, so it is bound by reading the weights:
int8 reads a quarter of float32's bytes, int4 an eighth. The products are torch's own CPU kernels
(``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``); for many rows at once (a
prefill chunk) a dense product beats the weight-only kernels: int8 widens its matrix to bfloat16,
block by block of output channels, for each product; int4 keeps its values widened to the model's
dtype (the float model's memory) and multiplies as the float model does.

Why int4 keeps the answers: a Q4_1 GGUF (the embedded model's) stores every linear weight as
``d * q + m`` in blocks of 32 inputs, with q in 0..15. Groups of 32 with their own minimum and
step find those values again exactly, so the int4 layers hold the file's own weights; what differs
from the float path is the bfloat16 rounding of the products. The LM head comes from the file's
Q8_0 token embedding, which four bits cannot hold: it is checked int8 (:mod:`icecache.head`).

:func:`dequantized` and :func:`dequantized_groups` are the plain references the tests compare
:class:`Int8Linear` and :class:`Int4Linear` with.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from .config import WEIGHT_FORMATS

# The products run in bfloat16 (float32 accumulation inside the kernels): torch's int8 kernel is
# fast with bfloat16 activations only (with float32 ones it was 5x slower than float32 weights on
# this CPU), and a bfloat16 product of many rows uses the CPU's bfloat16 instructions (2.5x
# float32's speed here: docs/results.md, "Weights"). The layer's input and output keep the
# model's dtype.
COMPUTE = torch.bfloat16

# Up to this many rows the weight-only kernels run; above it, the widened product (measured at
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

    form = "int8"

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


_prompt = threading.local()


@contextlib.contextmanager
def prompt_products(half: torch.dtype | None = None):
    """Inside it (this thread), every product of an int4 layer and of the checked head is the float
    model's product of the same weights, however few the rows: a prompt's short last chunk and the
    prompt tokens a sparse prefill runs one at a time compute as the float model, so that the cache
    and the first answer token are the float model's (an exact int4 layer holds the same values).
    Outside, rows of a decode step take the four-bit kernels.

    ``half`` (bfloat16; ``prompt_compute``): the prompt's products of those layers, and its
    chunks' attention (:func:`~icecache.cache.chunked.prefix_causal`), run in that dtype with float32
    sums, where the CPU multiplies it natively (4x float32's speed on this machine class's
    AVX512-BF16 CPUs, docs/results.md, "Prefill")."""
    before = getattr(_prompt, "on", False), getattr(_prompt, "half", None)
    _prompt.on, _prompt.half = True, half
    try:
        yield
    finally:
        _prompt.on, _prompt.half = before


def in_prompt() -> bool:
    """Whether :func:`prompt_products` is on in this thread."""
    return getattr(_prompt, "on", False)


def prompt_half() -> torch.dtype | None:
    """The 16-bit dtype the prompt's products run in (:func:`prompt_products`), or None."""
    return getattr(_prompt, "half", None) if getattr(_prompt, "on", False) else None


def prompt_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A prompt's product of a packed layer (:class:`Int4Linear`, and the GGUF layers of
    :mod:`icecache.gguf_weights`): its float values (``layer.widened``), in the prompt's 16-bit
    dtype where one is set (:func:`prompt_products`)."""
    half = prompt_half()
    if half is not None and x.reshape(-1, x.shape[-1]).shape[0] > 1:
        w = layer._half_weights.get(half)
        if w is None:  # made at the first 16-bit prompt (the model's memory + a quarter)
            w = layer._half_weights[half] = layer.widened.to(half)
        y = nn.functional.linear(x.to(half), w, None if layer.bias is None else layer.bias.to(half))
        return y.to(layer.act_dtype)
    return nn.functional.linear(x.to(layer.act_dtype), layer.widened, layer.bias)


def int4_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An :class:`Int4Linear`'s product: a decode step's rows through torch's int4 kernel, a
    prompt's through :func:`prompt_product`."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.shape[0] > ROWS_INT8_KERNEL or in_prompt():
        return prompt_product(layer, x)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(COMPUTE).contiguous(), layer.kernel_weight,
                                                  GROUP, layer.kernel_table)
    y = y.to(layer.act_dtype)
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.reshape(*shape[:-1], layer.out_features)


# int4: inputs per group (a Q4_1 block); torch's CPU int4 packing takes output channels in
# multiples of 16
GROUP = 32
INT4_OUT_MULTIPLE = 16


def quantize_groups(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, step, low): ``q`` int32 in 0..15 shaped like ``weight``, ``step`` and ``low`` float32
    per output channel and group of ``group`` inputs, with ``weight ~= q * step + low``. A group's
    smallest weight is ``low`` and its largest ``low + 15 * step`` (both exact up to float
    rounding); a group of equal weights gets step 1 and q 0."""
    w = weight.detach().float()
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    low, high = wg.amin(-1), wg.amax(-1)
    step = (high - low) / 15
    step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.clamp(torch.round((wg - low[..., None]) / step[..., None]), 0, 15).to(torch.int32)
    return q.reshape(n, k).contiguous(), step.contiguous(), low.contiguous()


def dequantized_groups(q: torch.Tensor, step: torch.Tensor, low: torch.Tensor,
                       dtype: torch.dtype = torch.float32, group: int = GROUP) -> torch.Tensor:
    """The float matrix an int4 weight stands for (the reference)."""
    n, k = q.shape
    w = q.reshape(n, k // group, group).float() * step.float()[..., None] + low.float()[..., None]
    return w.reshape(n, k).to(dtype)


def int4_fits(linear: nn.Linear) -> bool:
    """Whether torch's int4 kernel takes this layer's shape."""
    return linear.in_features % GROUP == 0 and linear.out_features % INT4_OUT_MULTIPLE == 0


class Int4Linear(nn.Module):
    """A linear layer with 4-bit weights in groups of :data:`GROUP` inputs, each group with its
    own step and minimum."""

    form = "int4"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if not int4_fits(linear):
            raise ValueError(f"int4 needs inputs in multiples of {GROUP} and outputs in multiples of "
                             f"{INT4_OUT_MULTIPLE} (got {linear.in_features} -> {linear.out_features})")
        q, step, low = quantize_groups(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the kernel's own layout and its (step, offset) table: it computes (q - 8) * step + offset
        self.register_buffer("kernel_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2),
                             persistent=False)
        table = torch.stack([step, low + 8 * step], dim=-1).transpose(0, 1).contiguous().to(COMPUTE)
        self.register_buffer("kernel_table", table, persistent=False)
        # the same values in the model's dtype, for the many-row product (a prefill chunk): on a
        # CPU without bfloat16 instructions a bfloat16 product is 4x slower than a float32 one,
        # and the 4-bit values widened for each chunk made a short prompt's prefill 2.7x slower
        # than the float model's (docs/results.md, "Weights"). Kept, they make a chunk's product
        # the float model's own (the values are the same), at the float model's memory. Where
        # they equal the layer's weights (``exact``: a Q4_1 GGUF's layers), that tensor is kept
        # instead of a copy.
        widened = dequantized_groups(q, step, low, linear.weight.dtype)
        self.exact = torch.equal(widened, linear.weight.detach())
        self.register_buffer("widened", linear.weight.detach() if self.exact else widened, persistent=False)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.act_dtype = linear.weight.dtype
        self._half_weights: dict = {}  # the widened values in a 16-bit dtype (prompt_products(half))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_product(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP}"


def _head_names(model: nn.Module) -> set[str]:
    """The module names of the model's output projection (the LM head), if it says which."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return set()
    return {name for name, mod in model.named_modules() if mod is head}


def holds_in_int4(linear: nn.Linear, rows: int = 8) -> bool:
    """Whether 4-bit groups hold the first ``rows`` rows of ``linear``'s weights exactly: a cheap
    test before the whole layer is packed (a float layer fails it at once)."""
    w = linear.weight.detach()[:rows]
    q, step, low = quantize_groups(w)
    return torch.equal(dequantized_groups(q, step, low, w.dtype), w)


def exact_int4_layers(model: nn.Module) -> dict[str, Int4Linear]:
    """The int4 layers of ``model`` (the LM head aside) that hold their weights exactly in 4-bit
    groups, by module name. A GGUF's layers stored as 4-bit blocks of 32 with a step and an
    offset (Q4_1, the embedded model's; also Q4_0, and Q4_K's sub-blocks) pass; a float layer,
    or one of more bits (Q5_0, Q6_K, Q8_0), does not."""
    heads = _head_names(model)
    layers = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name not in heads and int4_fits(mod) and holds_in_int4(mod):
            new = Int4Linear(mod)
            if new.exact:
                layers[name] = new
    return layers


def apply_weights(model: nn.Module, fmt: str, device: str = "cpu", gguf: str | None = None) -> str:
    """Put ``model``'s linear layers in format ``fmt`` (:func:`quantize_model`) and return the
    format they are in. ``auto``, on the CPU: every layer that 4-bit groups hold exactly in int4
    (:func:`exact_int4_layers`); of the others, those the GGUF file ``gguf`` (the model's source,
    when it is one) stores in a format it can hold as bytes, from the file's own blocks
    (:func:`~icecache.gguf_weights.gguf_layers`); the rest as they are; and the LM head as a
    :class:`~.head.CheckedHead` (int8 logits, the possible maximum recomputed from its float weights:
    the greedy token is the float head's). Returns ``int4`` when every layer is int4 (the
    embedded model; what differs from the float model is the bfloat16 rounding of a decode
    step's products, 99.5% the same tokens), ``packed`` when every layer is int4 or from the file,
    ``int4+float`` or ``packed+float`` when some are, ``float+int8head`` when none is
    (:func:`weight_formats` counts them). Other devices keep the model's dtype (``float``)."""
    if fmt != "auto":
        quantize_model(model, fmt)
        return fmt
    if device != "cpu":
        return "float"
    layers, heads = exact_int4_layers(model), _head_names(model)
    rest = {name for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name not in heads and name not in layers}
    if gguf is not None and rest:  # (the embedded model's layers are all int4 already)
        from .gguf_weights import gguf_layers

        layers.update(gguf_layers(gguf, model, rest))
    every = all(name in layers or name in heads for name, mod in model.named_modules()
                if isinstance(mod, nn.Linear) and int4_fits(mod))
    quantize_model(model, "int4", layers, only_built=True)
    kind = "int4" if all(type(layer) is Int4Linear for layer in layers.values()) else "packed"
    return (kind if every else f"{kind}+float") if layers else "float+int8head"


def weight_formats(model: nn.Module) -> dict[str, int]:
    """How many of ``model``'s linear layers are in each form: ``int4`` (:class:`Int4Linear`),
    a GGUF format's name (its layers held as the file's bytes), ``int8``, ``int8 head (checked)``, ``float``."""
    counts: dict[str, int] = {}
    for mod in model.modules():
        kind = getattr(mod, "form", None) or ("float" if isinstance(mod, nn.Linear) else None)
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def quantize_model(model: nn.Module, fmt: str, built: dict[str, nn.Module] | None = None,
                   only_built: bool = False) -> int:
    """Replace the linear layers of ``model`` in format ``fmt``; returns how many were replaced.
    ``float`` leaves the model as it is; ``int8`` replaces every linear layer, the LM head
    included; ``int4`` every one whose shape its kernel takes, and the LM head as a
    :class:`~.head.CheckedHead` (int8 logits, the possible maximum recomputed in float). ``built``: layers
    made already, by module name (:func:`exact_int4_layers`'s); ``only_built``: of the others,
    the LM head alone."""
    from .head import CheckedHead  # (it builds on this module's int8 rows)

    if fmt not in WEIGHT_FORMATS or fmt == "auto":
        raise ValueError(f"unknown weight format '{fmt}' (known: {', '.join(WEIGHT_FORMATS)})")
    if fmt == "float":
        return 0
    heads = _head_names(model) if fmt == "int4" else set()
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)
               and (name in heads or fmt == "int8" or (int4_fits(mod) and not only_built)
                    or name in (built or {}))]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if built is not None and name in built:
            new = built[name]
        elif fmt == "int8":
            new = Int8Linear(mod)
        else:
            new = CheckedHead(mod) if name in heads else Int4Linear(mod)
        setattr(parent, child, new)
    return len(targets)
