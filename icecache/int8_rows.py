"""One input row against an int8 matrix with a scale per output row, on the CPU (numba).

torch's weight-only int8 kernel (``_weight_int8pack_mm``) takes its input in bfloat16 and, on a
CPU without AVX-512 (an AVX2 EPYC, two threads), read the checked head's int8 rows at about
5 GB/s: 32-39 ms a token for Gemma 3's 262k x 640 head, 5.7-6.3 ms for the embedded model's
49k x 576, where this kernel takes 13-14 and 2.2-2.5 ms on the same machine. Here the rows are stored in tiles of :data:`BLOCK` output rows, input-major inside a
tile (``tiles[b, k, r]`` is row ``b * BLOCK + r``'s weight ``k``), so the inner loop runs over
contiguous bytes of 64 output rows at once and the compiler vectorizes it for whatever vector
width the machine has (numba compiles for the host CPU). Each tile is one task of numba's
threads. The input stays float32 (no rounding to bfloat16), the sums are float32 in any order.

The reference is the float product with the dequantized matrix (:func:`reference`); the tests
hold the kernel to it within :func:`sum_error`'s bound.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from . import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)

BLOCK = 64  # output rows per tile: 64 bytes per input, two 32-byte vectors (AVX2) or one 64-byte


def tile(q: torch.Tensor) -> np.ndarray:
    """int8 (rows, inputs) -> (tiles, inputs, BLOCK) int8, the last tile padded with zero rows."""
    n, k = q.shape
    tiles = -(-n // BLOCK)
    out = np.zeros((tiles * BLOCK, k), np.int8)
    out[:n] = q.detach().cpu().numpy()
    return np.ascontiguousarray(out.reshape(tiles, BLOCK, k).transpose(0, 2, 1))


@njit(parallel=True, fastmath=True, cache=True)
def bounded_product(tiles, scale, bias, bound, l1, x, out, upper, tile_floor):
    """out[i] = scale[i] * sum_k q[i, k] * x[k] + bias[i] for every row i < len(out); with each
    row's bound ``e = bound[i] * l1`` (plus the rounding of the sum with the bias and 1e-6):
    ``upper[i] = out[i] + e`` and, per tile, the largest ``out[i] - e`` in ``tile_floor`` (the
    checked head's candidates in the same pass)."""
    nb, k = tiles.shape[0], tiles.shape[1]
    n = out.shape[0]
    for b in prange(nb):
        # BLOCK, a compile-time constant: the inner loop unrolls into whole vectors held in registers
        acc = np.zeros(BLOCK, np.float32)
        for j in range(k):
            a = x[j]
            for r in range(BLOCK):
                acc[r] += np.float32(tiles[b, j, r]) * a
        low = -np.inf
        for r in range(min(BLOCK, n - b * BLOCK)):
            i = b * BLOCK + r
            v = acc[r] * scale[i] + bias[i]
            e = bound[i] * l1 + abs(v) * 2.0 ** -23 + 1e-6
            out[i] = v
            upper[i] = v + e
            low = max(low, v - e)
        tile_floor[b] = low


def product(tiles: np.ndarray, scale: torch.Tensor, x: torch.Tensor, rows: int,
            bias: torch.Tensor | None = None, bound: torch.Tensor | None = None,
            l1: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``x`` (inputs,) float32 -> (the product (rows,) float32, ``upper``, the largest lower
    end) through :func:`bounded_product`; ``scale``, ``bias`` and ``bound`` (rows,) float32
    (None: zeros)."""
    out, upper = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
    floors = np.empty(tiles.shape[0], np.float32)
    zeros = np.zeros(rows, np.float32) if bias is None or bound is None else None
    bounded_product(tiles, scale.numpy(), zeros if bias is None else bias.float().numpy(),
                    zeros if bound is None else bound.numpy(), np.float32(l1),
                    x.detach().float().contiguous().numpy(), out.numpy(), upper.numpy(), floors)
    return out, upper, float(floors.max())


def sum_error(inputs: int) -> float:
    """Relative bound on the kernel's float32 sums: any order of ``inputs`` products and sums
    errs by at most ``inputs`` units of 2**-24 of the sum of absolute terms (first order), and the
    final product with the scale by one more; twice that is allowed."""
    return (inputs + 1) * 2.0 ** -23


def reference(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The plain product the kernel stands for: float64 sums of the dequantized rows."""
    return (q.double() * scale.double()[:, None]) @ x.double()


# Grouped bytes: each row's weights as ``u * step + low`` with ``u`` a byte (0..255) and a step and
# minimum per group of GROUP inputs (a GGUF layer's blocks, icecache.gguf_weights): one byte a
# weight whatever the format's bits (Q4 to Q8), exact wherever ``u * step + low`` is.
GROUP = 32


def tile_groups(u: np.ndarray, step: np.ndarray, low: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, inputs) bytes and (rows, groups) steps and minimums -> (tiles, tables (tiles, groups,
    2, BLOCK) float32: step then minimum), the last tile padded with zero rows. ``tiles`` (tiles,
    inputs, BLOCK) uint8; where every ``u`` is under 16 (4-bit formats: an int4 layer, Q4_0, Q4_1,
    Q4_K), two a byte, (tiles, inputs / 2, BLOCK): input 2i in the low four bits, 2i + 1 in the
    high (:func:`grouped_tile` tells the two apart by the tiles' shape). A decode step's products
    read every weight once, so half the bytes is up to half the time: the embedded model's 30
    layers 9.5-9.9 against 10.6-12.5 ms a token (2 threads, an AVX2 EPYC, same run)."""
    n, k = u.shape
    nb = -(-n // BLOCK)
    pad = nb * BLOCK - n
    u = np.concatenate([u, np.zeros((pad, k), np.uint8)]) if pad else u
    table = np.stack([step, low], axis=-1).astype(np.float32)  # (rows, groups, 2)
    table = np.concatenate([table, np.zeros((pad, *table.shape[1:]), np.float32)]) if pad else table
    tiles = np.ascontiguousarray(u.reshape(nb, BLOCK, k).transpose(0, 2, 1))
    if int(u.max(initial=0)) < 16:
        tiles = np.ascontiguousarray(tiles[:, 0::2] | (tiles[:, 1::2] << 4))
    tables = np.ascontiguousarray(table.reshape(nb, BLOCK, k // GROUP, 2).transpose(0, 2, 3, 1))
    return tiles, tables


@njit(fastmath=True, cache=True)
def group_sums(x):
    """Each group's sum of the input (GROUP inputs each)."""
    groups = x.shape[0] // GROUP
    sums = np.zeros(groups, np.float32)
    for g in range(groups):
        for j in range(g * GROUP, g * GROUP + GROUP):
            sums[g] += x[j]
    return sums


@njit(fastmath=True, cache=True)
def grouped_tile(tiles, tables, x, sums, out, b):
    """Tile ``b`` of :func:`grouped_product` (one task; a caller's own parallel loop can run it).
    Tiles of half the inputs hold two 4-bit values a byte (:func:`tile_groups`): each byte as a
    float ``f``, its high half ``floor(f / 16)`` and its low ``f - 16 * high``, both exact (integer
    arithmetic on the bytes made numba widen them to 64 bits, and the loop slower than the bytes')."""
    k = x.shape[0]
    n = out.shape[0]
    packed = tiles.shape[1] < k
    total = np.zeros(BLOCK, np.float32)
    for g in range(k // GROUP):
        acc = np.zeros(BLOCK, np.float32)
        if packed:
            for j in range(g * (GROUP // 2), (g + 1) * (GROUP // 2)):
                a0, a1 = x[2 * j], x[2 * j + 1]
                for r in range(BLOCK):
                    f = np.float32(tiles[b, j, r])
                    high = np.floor(f * np.float32(0.0625))
                    acc[r] += (f - np.float32(16.0) * high) * a0 + high * a1
        else:
            for j in range(g * GROUP, g * GROUP + GROUP):
                a = x[j]
                for r in range(BLOCK):
                    acc[r] += np.float32(tiles[b, j, r]) * a
        s = sums[g]
        for r in range(BLOCK):
            total[r] += tables[b, g, 0, r] * acc[r] + tables[b, g, 1, r] * s
    for r in range(min(BLOCK, n - b * BLOCK)):
        out[b * BLOCK + r] = total[r]


@njit(parallel=True, fastmath=True, cache=True)
def grouped_product(tiles, tables, x, out):
    """out[i] = sum over groups g of step[i, g] * sum_{k in g} u[i, k] * x[k] + low[i, g] * sum_{k in g} x[k]
    for every row i < len(out) (the tables of :func:`tile_groups`), a tile per task."""
    sums = group_sums(x)
    for b in prange(tiles.shape[0]):
        grouped_tile(tiles, tables, x, sums, out, b)


def grouped_sum_error(inputs: int) -> float:
    """Relative bound on :func:`grouped_product`'s float32 sums against the sum of absolute terms
    ``sum_k |u_k step_g x_k| + sum_g |low_g| sum_k |x_k|``: as :func:`sum_error`, with the
    products by step and minimum and the group sums counted (four more roundings a term)."""
    return (inputs + 4) * 2.0 ** -23
