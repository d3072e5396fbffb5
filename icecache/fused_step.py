"""A decode step's decoder layers in numba, from the layers' own quantized values.

:class:`~icecache.fast_step.FastStep` runs a layer as some fifty torch ops and four to seven
weight products; on a 2-core CPU each op's fixed cost (a few microseconds of dispatch, a hand-off
to the thread pool) made a step of the embedded model's 30 layers take several times what its
arithmetic and its weights' bytes need. Here a layer is two numba calls around its attention:
:func:`decoder_pre` (the input RMS norm, the q/k/v products with their biases, per-head q/k norms
where the model has them, RoPE with the model's own angles) and :func:`decoder_post` (the output
product, the residual, the MLP's norms, the MLP, the residual); between them the cache's own
``update`` and the method's own attention function, so every method and every kind of layer (a
sliding window's included) runs through it (:func:`run_split`). Where every cache layer is a
plain dense growing layer (:class:`~icecache.cache.dense.GrowingLayer`: the ``dense`` method, and
``ice`` while it keeps every layer dense, distances past the trained context clamped or not, its
rows in float32 or in its 16-bit decode dtypes) or a model's window layer (its decode ring,
:class:`~icecache.cache.window.WindowLayer`), the whole layer is one call (:func:`decoder_layer`,
:func:`run_layers`: each layer with its own RoPE kind, scale and cap on its scores), and every
layer of the step one call where none clamps its distances and their buffers share one dtype
(:func:`decoder_layers`): the new key and value go into the layer's buffer and attention over its
rows runs in numba too (:func:`~icecache.cache.score_kernels.dense_decode_fused`). Where only
some layers are such (Gemma 3 under ``ice`` with its pages: five window layers, then a global
layer of pages), each run of them goes the same way and the others split: Gemma 3 270M's 16k step
21.6 against 24.5 ms on a 2-core AVX2 machine (medians of 6 x 24 steps, builds alternated).

The products run from each layer's weights held as bytes (4-bit values two a byte) with a step and
a minimum per group of 32 inputs (:func:`~icecache.int8_rows.grouped_tile`, the input in float32;
with ``decode_inputs: int16`` the two-a-byte tiles take it rounded to int16 and sum in integers,
:mod:`~icecache.int16_inputs`): a GGUF layer's own
(:class:`~icecache.gguf_weights.GroupedLinear`), or an exact int4 layer's values
(:class:`~icecache.weights.Int4Linear`, made at the first step: two values a byte beside its
own packed form). Which models: the fast step's (Llama, Mistral, Qwen 2 and 3, Gemma 2 and 3:
their norms, Gemma's ``1 + weight`` and its norms around the attention and the MLP, SiLU or
GELU's tanh form) whose every layer's seven products are one of those two, on the CPU in
float32, outside a prompt; otherwise the torch step, which stays the reference
(tests/test_fused_step.py: 64 steps' logits within float rounding of transformers' forward over
the same values in float32, and every method against the float model's torch step; int16 inputs
within 1e-3 of the largest logit).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from numba import njit, prange

from . import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)
from .cache.dense import kernel_rows
from .cache.score_kernels import dense_decode_fused, exp32, narrow
from .int8_rows import tile_groups
from .int16_inputs import prepare_input, tile_product

NO_BIAS = np.zeros(0, np.float32)


@njit(fastmath=True, cache=True)
def _rms(x, w, eps):
    """An RMS norm by ``w``, in float32 throughout (a float64 scale made the row float64,
    and every product after it half as fast)."""
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i] * x[i]
    r = np.float32(1.0) / np.float32(np.sqrt(s / np.float32(x.shape[0]) + eps))
    return w * (x * r)


@njit(fastmath=True, cache=True)
def _rope(v, heads, d, cos, sin):
    """transformers' rotation, ``v * cos + rotate_half(v) * sin``, head by head, in place."""
    half = d // 2
    for h in range(heads):
        o = h * d
        for j in range(half):
            a, b = v[o + j], v[o + half + j]
            v[o + j] = a * cos[j] - b * sin[j]
            v[o + half + j] = b * cos[half + j] + a * sin[half + j]


@njit(fastmath=True, cache=True)
def _head_norms(v, heads, d, w, eps):
    """Qwen 3's and Gemma 3's per-head RMS norm of q or k (``w`` (d,)), head by head, in place."""
    for h in range(heads):
        v[h * d:(h + 1) * d] = _rms(v[h * d:(h + 1) * d], w, eps)


@njit(parallel=True, fastmath=True, cache=True)
def decoder_pre(x, norms, eps, weights, tables, biases, rows, head_norms, cos, sin, H, Hk, d, rounded):
    """A decoder layer up to its attention, for one token: ``x`` (D,) float32 -> (q, k, v)
    (H * d,), (Hk * d,), (Hk * d,) with RoPE on q and k. ``norms[0]`` the input norm's weight;
    ``weights``/``tables``/``biases``/``rows``: the layer's seven products (q, k, v, o, gate,
    up, down) in :func:`~icecache.int8_rows.tile_groups` form (no bias: empty) and their output
    sizes; ``head_norms`` (2, d): q's and k's per-head norms before RoPE (Qwen 3, Gemma 3; none:
    (0, d)); ``cos``/``sin`` (d,); ``rounded``: the normed input rounded to int16 for the products of
    two-a-byte tiles (:mod:`~icecache.int16_inputs`). q, k and v's tiles run in one parallel loop."""
    h = _rms(x, norms[0], eps)
    sums, hq, hs = prepare_input(h, rounded)
    q, k, v = np.empty(rows[0], np.float32), np.empty(rows[1], np.float32), np.empty(rows[2], np.float32)
    wq, wk, wv, tq, tk, tv = weights[0], weights[1], weights[2], tables[0], tables[1], tables[2]
    nq, nk = wq.shape[0], wk.shape[0]
    for t in prange(nq + 2 * nk):
        if t < nq:
            tile_product(wq, tq, h, sums, hq, hs, q, t)
        elif t < nq + nk:
            tile_product(wk, tk, h, sums, hq, hs, k, t - nq)
        else:
            tile_product(wv, tv, h, sums, hq, hs, v, t - nq - nk)
    for out, bias in ((q, biases[0]), (k, biases[1]), (v, biases[2])):
        if bias.shape[0]:
            out += bias
    if head_norms.shape[0]:
        _head_norms(q, H, d, head_norms[0], eps)
        _head_norms(k, Hk, d, head_norms[1], eps)
    _rope(q, H, d, cos, sin)
    _rope(k, Hk, d, cos, sin)
    return q, k, v


@njit(parallel=True, fastmath=True, cache=True)
def _product(w, tb, x, rows, bias, rounded):
    """One layer's grouped-bytes product of ``x`` (its tiles in parallel) plus its bias (empty: none)."""
    out = np.empty(rows, np.float32)
    sums, xq, xs = prepare_input(x, rounded)
    for t in prange(w.shape[0]):
        tile_product(w, tb, x, sums, xq, xs, out, t)
    if bias.shape[0]:
        out += bias
    return out


@njit(fastmath=True, cache=True)
def _gelu_tanh(x):
    """GELU by its tanh form (transformers' ``gelu_pytorch_tanh``, Gemma's MLP) of one float32:
    ``0.5 x (1 + tanh(y))`` written as ``x / (1 + e^(-2y))`` (the same function, and no
    cancellation where tanh(y) is near -1), through :func:`exp32`, which a loop vectorizes."""
    y = np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)
    return x / (np.float32(1.0) + exp32(np.float32(-2.0) * y))


SILU, GELU_TANH = 0, 1  # the MLP's activations the fused layers know (decoder_post's ``act``)


@njit(parallel=True, fastmath=True, cache=True)
def decoder_post(x, attn, norms, eps, weights, tables, biases, rows, act, rounded):
    """The rest of the layer after its attention: ``x`` (D,) the layer's input, ``attn`` (H * d,)
    its attention's output -> the layer's output. ``norms`` (2, D), the Llama family: the output
    product and the residual, the post-attention norm ``norms[1]``, the MLP and the residual;
    (4, D), Gemma's "sandwich": ``norms[1]`` on the output product before its residual,
    ``norms[2]`` before the MLP and ``norms[3]`` on its output before the residual. ``act``:
    :data:`SILU` or :data:`GELU_TANH` on the gate; gate and up's tiles in one loop; ``rounded``: as
    :func:`decoder_pre`'s, for each product's input."""
    sandwich = norms.shape[0] == 4
    o = _product(weights[3], tables[3], attn, rows[3], biases[3], rounded)
    if sandwich:
        x = x + _rms(o, norms[1], eps)
        h = _rms(x, norms[2], eps)
    else:
        x = x + o
        h = _rms(x, norms[1], eps)
    sums, hq, hs = prepare_input(h, rounded)
    gate, up = np.empty(rows[4], np.float32), np.empty(rows[5], np.float32)
    wg, wu, tg, tu = weights[4], weights[5], tables[4], tables[5]
    ng = wg.shape[0]
    for t in prange(2 * ng):
        if t < ng:
            tile_product(wg, tg, h, sums, hq, hs, gate, t)
        else:
            tile_product(wu, tu, h, sums, hq, hs, up, t - ng)
    if biases[4].shape[0]:
        gate += biases[4]
    if biases[5].shape[0]:
        up += biases[5]
    mixed = np.empty_like(gate)
    for i in range(gate.shape[0]):  # exp32, not np.exp (a call per element, this loop left scalar)
        if act == GELU_TANH:
            mixed[i] = _gelu_tanh(gate[i]) * up[i]
        else:
            mixed[i] = gate[i] / (np.float32(1.0) + exp32(-gate[i])) * up[i]
    m = _product(weights[6], tables[6], mixed, rows[6], biases[6], rounded)
    if sandwich:
        m = _rms(m, norms[3], eps)
    return x + m


@njit(fastmath=True, cache=True)
def decoder_layer(x, layer, cos, sin, kbuf, vbuf, slot, rows, scale, cap, H, Hk, d, turn, k0buf, c):
    """One decoder layer for one token over a cache layer's rows: :func:`decoder_pre`, the new
    key and value written into row ``slot`` of ``kbuf``/``vbuf`` (Hk, capacity, d), attention
    over rows 0..rows-1 (a growing layer: ``slot`` its row count, ``rows`` one more; a window
    layer's ring, :class:`~icecache.cache.window.WindowLayer`: the slot leaving the window),
    scores scaled by ``scale`` and capped where ``cap`` > 0
    (:func:`~icecache.cache.score_kernels.dense_decode_fused`; ``c`` > 0, clamped distances,
    :meth:`~icecache.cache.dense.GrowingLayer.clamp_rows`: the first ``c`` rows score against
    ``k0buf``, the oldest keys un-rotated, with the query turned by ``turn`` (d, d)),
    :func:`decoder_post`. ``layer``: the layer's values, :attr:`FusedLayers.layers`."""
    norms, eps, weights, tables, biases, wrows, head_norms, act, rounded = layer
    q, k, v = decoder_pre(x, norms, eps, weights, tables, biases, wrows, head_norms, cos, sin, H, Hk, d, rounded)
    for g in range(Hk):
        for j in range(d):
            kbuf[g, slot, j] = narrow(k[g * d + j], kbuf[g, slot, j])
            vbuf[g, slot, j] = narrow(v[g * d + j], vbuf[g, slot, j])
    q3 = q.reshape(Hk, H // Hk, d)
    far = q3
    if c > 0:
        far = np.zeros((Hk, H // Hk, d), np.float32)
        for i in range(Hk):
            for g in range(H // Hk):
                for m in range(d):
                    a = q3[i, g, m]
                    for j in range(d):
                        far[i, g, j] += a * turn[m, j]
    attn = np.empty((Hk, H // Hk, d), np.float32)
    dense_decode_fused(q3, kbuf, vbuf, rows, scale, cap, far, k0buf, c, attn)
    return decoder_post(x, attn.reshape(H * d), norms, eps, weights, tables, biases, wrows, act, rounded)


@njit(fastmath=True, cache=True)
def decoder_layers(x, layers, keys, values, at, slots, rows, angle, coss, sins, scales, caps, H, Hk, d):
    """Every layer of a step through :func:`decoder_layer`, none of them clamped, in one call:
    ``layers`` (a typed list) holds each layer's values; ``keys``/``values`` the row buffers as
    two typed lists each, float32 rows and 16-bit rows (:func:`_row_lists`), layer ``i``'s in
    list ``at[i, 0]`` at ``at[i, 1]`` (keys) and ``at[i, 2]`` at ``at[i, 3]`` (values), so that
    layers of both kinds (Gemma 3's float window rings beside its 16-bit global layers) run in
    the one call; ``slots``/``rows`` its new row's slot and the rows it attends, ``angle`` the
    row of ``coss``/``sins`` (kinds, d) its RoPE takes, ``scales``/``caps`` its scores' scale
    and cap. One call instead of one a layer (each call unboxes some twenty-five arrays and its
    tuples): the embedded model's 1k step 27.9 against 31.6 ms on a 2-core AVX2 machine
    (medians of 16 alternated blocks of 16 steps)."""
    no_turn = np.zeros((d, d), np.float32)
    no_k0 = np.zeros((Hk, 0, d), np.float32)
    for i in range(len(layers)):
        cos, sin = coss[angle[i]], sins[angle[i]]
        k, v = at[i, 1], at[i, 3]
        if at[i, 0] == 0 and at[i, 2] == 0:
            x = decoder_layer(x, layers[i], cos, sin, keys[0][k], values[0][v], slots[i], rows[i], scales[i],
                              caps[i], H, Hk, d, no_turn, no_k0, 0)
        elif at[i, 0] == 0:
            x = decoder_layer(x, layers[i], cos, sin, keys[0][k], values[1][v], slots[i], rows[i], scales[i],
                              caps[i], H, Hk, d, no_turn, no_k0, 0)
        elif at[i, 2] == 0:
            x = decoder_layer(x, layers[i], cos, sin, keys[1][k], values[0][v], slots[i], rows[i], scales[i],
                              caps[i], H, Hk, d, no_turn, no_k0, 0)
        else:
            x = decoder_layer(x, layers[i], cos, sin, keys[1][k], values[1][v], slots[i], rows[i], scales[i],
                              caps[i], H, Hk, d, no_turn, no_k0, 0)
    return x


def _bytes_of(mod: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A linear layer's weights as (tiles, tables) of grouped bytes, or None where it has none
    exactly: a GGUF layer's own, an exact int4 layer's values (made here)."""
    from .gguf_weights import GroupedLinear
    from .weights import Int4Linear, quantize_groups

    if isinstance(mod, GroupedLinear):
        return mod.tiles.numpy(), mod.tables.numpy()
    if type(mod) is Int4Linear and mod.exact:
        q, step, low = quantize_groups(mod.widened)
        return tile_groups(q.numpy().astype(np.uint8), step.numpy(), low.numpy())
    return None


ACTIVATIONS = {"silu": SILU, "gelu_pytorch_tanh": GELU_TANH}


def _norm_of(norm: Any, gemma: bool) -> tuple[np.ndarray, float]:
    """An RMS norm module's weight as the fused layers scale by (Gemma's ``1 + weight``) and its
    epsilon."""
    w = norm.weight.detach().float()
    return (1.0 + w if gemma else w).contiguous().numpy(), float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))


class FusedLayers:
    """The values :func:`decoder_layer` reads, per layer (made once per model, :meth:`of`):
    ``layers[i]`` is ``(norms, eps, weights, tables, biases, rows, head_norms, act, rounded)``, the
    arguments of :func:`decoder_pre` and :func:`decoder_post`; ``modules[i]`` the seven linear
    modules they were made from."""

    def __init__(self, layers: list[tuple], modules: list[tuple]):
        self.layers = layers
        self.modules = modules
        self._typed: dict = {}  # (lo, hi) -> layers lo..hi-1's values as one typed list (:meth:`typed`)

    def typed(self, lo: int = 0, hi: int | None = None):
        """Layers ``lo`` to ``hi - 1``'s values (default: every layer) as the typed list
        :func:`decoder_layers` takes (made at the first call for that range), or None where their
        types differ (a typed list holds one type)."""
        key = (lo, len(self.layers) if hi is None else hi)
        made = self._typed.get(key)
        if made is None:
            made = self._typed[key] = _typed_list(self.layers[key[0]:key[1]]) or False
        return made or None

    @staticmethod
    def _modules(layer: Any) -> tuple:
        a, mlp = layer.self_attn, layer.mlp
        return (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    @staticmethod
    def of(model: Any, rounded: bool = False) -> FusedLayers | None:
        """The model's fused layers, or None where a layer cannot be fused (module docstring);
        ``rounded``: their products of two-a-byte tiles take the input rounded to int16."""
        config = model.config
        gemma = config.model_type in ("gemma2", "gemma3_text")
        act = ACTIVATIONS.get(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"))
        if act is None:
            return None
        layers, modules = [], []
        for layer in model.model.layers[: config.num_hidden_layers]:
            a = layer.self_attn
            try:
                mods = FusedLayers._modules(layer)
            except AttributeError:  # (a joined qkv or gate/up projection)
                return None
            made = [_bytes_of(m) for m in mods]
            if any(m is None for m in made):
                return None
            kinds = (["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm"] if gemma else ["input_layernorm", "post_attention_layernorm"])
            norms = [_norm_of(getattr(layer, kind), gemma) for kind in kinds]
            heads = [_norm_of(a.q_norm, gemma), _norm_of(a.k_norm, gemma)] if hasattr(a, "q_norm") else []
            eps = {e for _, e in norms + heads}
            if len(eps) != 1:  # (one epsilon a layer)
                return None
            head_norms = (np.stack([w for w, _ in heads]) if heads else np.zeros((0, a.head_dim), np.float32))
            biases = tuple(NO_BIAS if m.bias is None else m.bias.detach().float().contiguous().numpy() for m in mods)
            layers.append((np.stack([w for w, _ in norms]), np.float32(eps.pop()), tuple(m[0] for m in made),
                           tuple(m[1] for m in made), biases, np.array([m.out_features for m in mods], np.int64),
                           head_norms, act, rounded))
            modules.append(mods)
        return FusedLayers(layers, modules)

    def current(self, model: Any) -> bool:
        """Whether the model still has the modules these were made from (asked every step: read
        from the modules' own tables, not by attribute, which took about 1 ms a step)."""
        for mods, layer in zip(self.modules, model.model.layers, strict=False):
            a, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
            held = (a.get("q_proj"), a.get("k_proj"), a.get("v_proj"), a.get("o_proj"), mlp.get("gate_proj"),
                    mlp.get("up_proj"), mlp.get("down_proj"))
            if any(x is not y for x, y in zip(held, mods, strict=True)):
                return False
        return True


def whole_layers(cache: Any, num_layers: int) -> list | None:
    """Each of the cache's layers where it can take a whole fused layer, else None in its place: a
    plain dense growing layer holding the prompt in float32 (its decode dtypes allowed: float16
    keys, bfloat16 values), or a window layer of float32 rows (its ring); None where the cache
    has no such list of layers."""
    from .cache.dense import GrowingLayer
    from .cache.window import WindowLayer

    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) < num_layers:
        return None
    return [layer if _whole(layer, GrowingLayer, WindowLayer) else None for layer in layers[:num_layers]]


def _whole(layer: Any, GrowingLayer: type, WindowLayer: type) -> bool:  # noqa: N803  (the classes)
    """Whether ``layer`` can take a whole fused layer (:func:`whole_layers`; the two classes
    imported once a step, not once a layer)."""
    if type(layer) is WindowLayer:
        return (layer.is_initialized and not layer.record_past and layer.keys.dim() == 4 and layer.keys.shape[0] == 1
                and layer.keys.dtype == torch.float32 and layer.values.dtype == torch.float32)
    return (type(layer) is GrowingLayer and layer.is_initialized and layer._k is not None
            and layer.decode_dtype in (None, torch.bfloat16)
            and layer._k.dtype in (torch.float32, layer.key_dtype)
            and layer._v.dtype in (torch.float32, layer.decode_dtype)
            and layer._k.shape[0] == 1)


def _typed_list(items: list):
    """``items`` as a numba typed list, or None where they are not all of one numba type."""
    from numba import typeof
    from numba.typed import List

    if not items or any(typeof(it) != typeof(items[0]) for it in items[1:]):
        return None
    out = List()
    for it in items:
        out.append(it)
    return out


# The 16-bit rows' types in the kernels (kernel_rows): float16 keys, bfloat16 values (GrowingLayer)
HALF_KEYS, HALF_VALUES = np.int16, np.uint16


def _row_lists(layers: list, bufs: list):
    """The layers' key and value buffers ``bufs`` ((keys, values) tensors a layer) as
    :func:`~icecache.cache.dense.kernel_rows` arrays for :func:`decoder_layers`: (keys, values,
    at), ``keys`` the float32 and the float16 buffers in two typed lists, ``values`` the float32
    and the bfloat16 ones, ``at`` (L, 4) where each layer's are; kept on the first layer while no
    buffer changes (a buffer grows every ``min_capacity`` rows or more; making the lists takes
    about a millisecond), or None where a buffer is of another kind. The lists' types are the
    same whichever kinds the layers hold (an empty list is typed all the same), so numba compiles
    one call for float rows, 16-bit rows and both."""
    keep = getattr(layers[0], "_fused_rows", None)
    if (keep is not None and len(keep[0]) == len(bufs)
            and all(a is k and b is v for a, b, (k, v) in zip(keep[0], keep[1], bufs, strict=True))):
        return keep[2]
    rows = [(kernel_rows(k[0]), kernel_rows(v[0])) for k, v in bufs]
    keys, key_at = two_lists([k for k, _ in rows], HALF_KEYS)
    values, value_at = two_lists([v for _, v in rows], HALF_VALUES)
    lists = None if keys is None or values is None else (keys, values, np.concatenate([key_at, value_at], axis=1))
    layers[0]._fused_rows = ([k for k, _ in bufs], [v for _, v in bufs], lists)
    return lists


def two_lists(arrays: list, half: type):
    """``arrays`` (3-D, C order) as two typed lists, the float32 ones and the ``half`` ones, and
    each one's (list, index) (n, 2); (None, None) where one is None or of another dtype."""
    from numba import typeof
    from numba.typed import List

    lists = tuple(List.empty_list(typeof(np.zeros((1, 1, 1), t))) for t in (np.float32, half))
    at = np.zeros((len(arrays), 2), np.int64)
    for i, a in enumerate(arrays):
        if a is None or a.dtype not in (np.float32, half) or not a.flags.c_contiguous:
            return None, None
        kind = 0 if a.dtype == np.float32 else 1
        at[i] = kind, len(lists[kind])
        lists[kind].append(a)
    return lists, at


def _angle_table(angles: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each layer's (cos, sin) tensors (the same pair for the layers of one RoPE kind) -> (each
    layer's row (L,), cos (kinds, d), sin (kinds, d)), a row a kind."""
    rows: dict = {}
    for cos, sin in angles:
        rows.setdefault(id(cos), (len(rows), cos, sin))
    kinds = list(rows.values())  # (in the order of their rows)
    return (np.array([rows[id(cos)][0] for cos, _ in angles], np.int64),
            np.stack([cos.detach().reshape(-1).float().numpy() for _, cos, _ in kinds]),
            np.stack([sin.detach().reshape(-1).float().numpy() for _, _, sin in kinds]))


def run_layers(fused: FusedLayers, layers: list, x: torch.Tensor, angles: list, heads: int, kv_heads: int,
               d: int, scales: np.ndarray, caps: np.ndarray) -> torch.Tensor:
    """Every decoder layer of one step through :func:`decoder_layer`, each cache layer grown by
    the step's row as its ``update`` would grow it (a window layer: its ring); ``x`` (D,)
    float32 -> (D,); ``angles[i]`` layer ``i``'s (cos, sin), d values each (one pair per RoPE
    kind), ``scales``/``caps`` (L,) float32 its scores' scale and cap (0: none). Where no layer
    clamps its distances and the layers' values and buffers each share one type, one call
    (:func:`decoder_layers`); otherwise a call a layer."""
    xn = x.detach().contiguous().numpy()
    return torch.from_numpy(_run_whole(fused, layers, 0, xn, _angle_table(angles), heads, kv_heads, d, scales, caps))


def _run_whole(fused: FusedLayers, layers: list, lo: int, xn: np.ndarray, table: tuple, heads: int,
               kv_heads: int, d: int, scales: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """:func:`run_layers` for the run of model layers ``lo`` to ``lo + len(layers) - 1`` (``layers``
    their cache layers, each one that takes a whole layer: :func:`whole_layers`); ``table``: every
    layer's :func:`_angle_table`; ``scales``/``caps``: every layer's."""
    from .cache.window import WindowLayer

    hi = lo + len(layers)
    angle, coss, sins = table
    clamps, slots, rows, bufs = [], [], [], []
    for layer in layers:
        if type(layer) is WindowLayer:
            slot, n = layer.ring_slot()
            clamps.append(None)
            bufs.append(layer._ring)
        else:
            slot = n = layer._n
            layer.take_decode_dtype()
            if n + 1 > layer._k.shape[2]:
                layer._reserve(n + 1, layer._k[:, :, :1], layer._v[:, :, :1])
            clamps.append(layer.clamp_rows(n + 1))
            bufs.append((layer._k, layer._v))
            n += 1
        slots.append(slot)
        rows.append(n)
    typed = fused.typed(lo, hi) if all(c is None for c in clamps) else None
    lists = _row_lists(layers, bufs) if typed is not None else None
    if lists is not None:
        xn = decoder_layers(xn, typed, *lists, np.array(slots, np.int64), np.array(rows, np.int64),
                            angle[lo:hi], coss, sins, scales[lo:hi], caps[lo:hi], heads, kv_heads, d)
    else:
        no_turn = np.zeros((d, d), np.float32)
        for j, ((kb, vb), clamp) in enumerate(zip(bufs, clamps, strict=True)):
            i = lo + j
            if clamp is None:
                turn, k0buf, c = no_turn, np.zeros((kv_heads, 0, d), np.float32), 0
            else:
                turn, k0buf, c = clamp[1].contiguous().numpy(), layers[j]._k0.numpy(), clamp[0].shape[1]
            xn = decoder_layer(xn, fused.layers[i], coss[angle[i]], sins[angle[i]], kernel_rows(kb[0]),
                               kernel_rows(vb[0]), slots[j], rows[j], scales[i], caps[i], heads, kv_heads, d, turn,
                               k0buf, c)
    for layer in layers:
        if type(layer) is WindowLayer:
            layer.ring_step()
        else:
            layer._n += 1
            layer.keys = layer._k[:, :, : layer._n]
            layer.values = layer._v[:, :, : layer._n]
    return xn


_paused = False


@contextlib.contextmanager
def unfused():
    """Inside it, decode steps take the torch ops (the bench's clock on the linear layers times
    their modules, which the fused layers do not call)."""
    global _paused
    before, _paused = _paused, True
    try:
        yield
    finally:
        _paused = before


def paused() -> bool:
    return _paused


def run_split(fused: FusedLayers, attention, x: torch.Tensor, angles: list, heads: int, kv_heads: int,
              d: int, whole: list | None = None, scales: np.ndarray | None = None,
              caps: np.ndarray | None = None) -> torch.Tensor:
    """Every decoder layer of one step as :func:`decoder_pre`, ``attention(i, q, k, v)`` (the
    cache's update and the method's attention function, given (1, H, 1, d) tensors; returns the
    output, (1, 1, H, d)) and :func:`decoder_post`: for any cache. ``x`` (D,) float32 -> (D,);
    ``angles[i]`` layer ``i``'s (cos, sin), d values each (Gemma 3: one pair per RoPE kind).

    ``whole`` (:func:`whole_layers`, with the layers' ``scales`` and ``caps`` as
    :func:`run_layers` takes them): each run of layers that take a whole layer goes through
    :func:`run_layers`' calls instead (Gemma 3's five window layers between two global ones in
    one call), the others split."""
    xn = x.detach().contiguous().numpy()
    table = _angle_table(angles)
    angle, coss, sins = table
    L = len(fused.layers)
    i = 0
    while i < L:
        if whole is not None and whole[i] is not None:
            j = i + 1
            while j < L and whole[j] is not None:
                j += 1
            xn = _run_whole(fused, whole[i:j], i, xn, table, heads, kv_heads, d, scales, caps)
            i = j
            continue
        norms, eps, weights, tables, biases, rows, head_norms, act, rounded = fused.layers[i]
        q, k, v = decoder_pre(xn, norms, eps, weights, tables, biases, rows, head_norms, coss[angle[i]], sins[angle[i]],
                              heads, kv_heads, d, rounded)
        out = attention(i, torch.from_numpy(q).view(1, 1, heads, d).transpose(1, 2),
                        torch.from_numpy(k).view(1, 1, kv_heads, d).transpose(1, 2),
                        torch.from_numpy(v).view(1, 1, kv_heads, d).transpose(1, 2))
        xn = decoder_post(xn, out.detach().reshape(-1).float().contiguous().numpy(), norms, eps, weights, tables,
                          biases, rows, act, rounded)
        i += 1
    return torch.from_numpy(xn)
