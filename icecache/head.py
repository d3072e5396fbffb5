"""The LM head on the CPU (``weights: int4`` and ``auto``): int8 logits, checked.

A decode step's head reads every row of a vocabulary-sized matrix (49k rows on the embedded
model, 262k on Gemma 3), so it is the largest single product of the step; int8 reads a quarter
of float32's bytes. But its logits choose every token, and a plain int8 head moved the embedded
model's agreement with the float model from 0.995 to 0.985 (docs/results.md, "Weights"): so the
int8 logits only narrow the choice, and the float weights decide it (:class:`CheckedHead`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import int8_rows
from .weights import COMPUTE, ROWS_INT8_KERNEL, in_prompt, quantize_rows

# Relative rounding of a bfloat16 value (8 significant bits, round to nearest: half a unit in the
# last place is 2**-9; twice that is allowed), and of the float32 sums inside the kernel.
BF16_REL = 2.0 ** -8
SUM_REL = 2.0 ** -16


# Rows of the head quantized at a time: a block's temporaries stay in the CPU's caches (the whole
# 49152 x 576 head at once took 1.2 s to load, blocks of 1024 rows take a fraction of that)
HEAD_BLOCK = 1024


def head_tables(weight: torch.Tensor, block: int = HEAD_BLOCK
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`CheckedHead`'s tables, block by block of rows: (int8 weight, its scale in the
    kernel's dtype, each row's largest error of the int8 row with that scale against the float
    row, each row's largest absolute weight). The same values as :func:`quantize_rows` and the
    whole-matrix errors (the test compares them)."""
    n, k = weight.shape
    dev = weight.device
    q = torch.empty(n, k, dtype=torch.int8, device=dev)
    scale_c = torch.empty(n, dtype=COMPUTE, device=dev)
    err, wmax = torch.empty(n, device=dev), torch.empty(n, device=dev)
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        w = weight[lo:hi].detach().float()
        qb, sb = quantize_rows(w)
        q[lo:hi], scale_c[lo:hi] = qb, sb.to(COMPUTE)
        err[lo:hi] = (qb.float() * scale_c[lo:hi].float()[:, None] - w).abs().amax(1)
        wmax[lo:hi] = w.abs().amax(1)
    return q, scale_c, err, wmax


class CheckedHead(nn.Module):
    """The LM head for ``int4``: logits from int8 weights (one scale per row, torch's int8 kernel),
    then every token whose logit could still be the largest recomputed from the float weights.

    For each row i of the head the approximate logit is within ``bound_i`` of the exact one:
    ``err_i * |x^|_1`` (the int8 row's largest weight error against the float row, with the
    kernel's bfloat16 scale) ``+ max|w_i| * |x - x^|_1`` (the input rounded to bfloat16)
    ``+ 2**-8 * |approx_i|`` (the output rounded to bfloat16) ``+ 2**-16 * max|w_i| * |x^|_1`` (the
    kernel's float32 sums). A token can be the exact maximum only if ``approx_i + bound_i`` reaches
    the largest ``approx_k - bound_k``; those tokens (a dozen or so on the embedded model) get their
    exact float logits, so the largest logit, and with it the greedy choice, is the float head's.
    The others keep their approximate values (within their bound). The weight is the float head's
    own tensor (the embedding it is tied to), so the head adds only its int8 copy."""

    form = "int8 head (checked)"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = w
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        q, scale_c, err, wmax = head_tables(w)
        # on the CPU the int8 rows live in int8_rows' tiles only (Gemma 3's are 168 MB)
        self.tiles = int8_rows.tile(q) if w.device.type == "cpu" else None
        self.register_buffer("qweight", None if self.tiles is not None else q, persistent=False)
        self.register_buffer("scale_c", scale_c, persistent=False)
        self.register_buffer("scale", scale_c.float(), persistent=False)
        self.register_buffer("row_err", err, persistent=False)
        self.register_buffer("row_max", wmax, persistent=False)
        # the tiles' bound per unit of |x|_1 (see candidates)
        self.register_buffer("row_bound", err + (wmax + err) * int8_rows.sum_error(self.in_features),
                             persistent=False)
        self.exact_rows = 0  # tokens recomputed from the float weights so far (for the bench)

    def candidates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(approximate logits [rows, V] in float32, mask of the tokens that could be the maximum).
        On the CPU the int8 logits come from :mod:`~icecache.int8_rows` with the input in float32:
        the bound is then ``err_i * |x|_1`` plus the kernel's float32 sums
        (:func:`~icecache.int8_rows.sum_error` times the largest weight, ``max|w_i| + err_i``, times
        ``|x|_1``): one product per row, ``row_bound``, in the kernel's pass over the rows."""
        if self.tiles is not None:
            approx, masks = [], []
            for r in x.float():
                out, upper, floor = int8_rows.product(self.tiles, self.scale, r, self.out_features, self.bias,
                                                      self.row_bound, float(r.abs().sum()))
                approx.append(out)
                masks.append(upper >= floor)
            return torch.stack(approx), torch.stack(masks)
        xc = x.to(COMPUTE).contiguous()
        approx = torch.ops.aten._weight_int8pack_mm(xc, self.qweight, self.scale_c).float()
        if self.bias is not None:
            approx += self.bias.float()
        xr = xc.float()
        l1 = xr.abs().sum(-1, keepdim=True)
        dx = (xr - x.float()).abs().sum(-1, keepdim=True)
        bound = (self.row_err * l1 + self.row_max * (dx + SUM_REL * l1)
                 + BF16_REL * approx.abs() + 1e-6)
        floor = (approx - bound).amax(-1, keepdim=True)
        return approx, approx + bound >= floor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] > ROWS_INT8_KERNEL or in_prompt():  # many rows, or a prompt: the float product
            return nn.functional.linear(x, self.weight, self.bias)
        approx, mask = self.candidates(rows)
        for r in range(rows.shape[0]):
            idx = mask[r].nonzero().flatten()
            exact = self.weight.index_select(0, idx) @ rows[r].to(self.weight.dtype)
            if self.bias is not None:
                exact = exact + self.bias.index_select(0, idx)
            approx[r].index_copy_(0, idx, exact.float())
            self.exact_rows += int(idx.numel())
        return approx.to(self.weight.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 + exact candidates"
