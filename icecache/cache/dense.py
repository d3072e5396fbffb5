"""A dense KV layer that grows in place, and the ``dense`` cache built from it.

transformers' ``DynamicLayer`` concatenates every new token onto the whole cache: at 32k tokens
that is a 25 MB copy per layer, per K and per V, at every decode step (about 8 ms per copy on
this machine's CPU, more than the attention itself). :class:`GrowingLayer` keeps keys and values
in a buffer with spare capacity (growing by an eighth when full: at most 12.5% unused, and
an amortized copy of 8 rows per new row) and hands out views of the filled part, so a
decode step writes one row. Decode attention then goes through transformers' SDPA path, which
for one query token packs the GQA group (each KV head is read once, not expanded per query
head). The ice cache's first (dense) layers use this layer; the ``dense`` method uses it for all.

The dense layers' attention lives here too: :func:`dense_decode` (one query token over a long
dense cache, the keys scored by numba on CPU) behind :func:`dense_attention`, and
:func:`windowed_dense` (a sparse-prefill chunk in a dense layer: sink + recent window only).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from .chunked import prefix_causal, prefix_causal_half, sdpa_forward, soft_cap
from .window import window_or


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` semantics (``keys``/``values`` are (B, H, n, d)) with in-place growth.

    ``decode_dtype`` (bfloat16 for a float32 model on a CPU, ``dense_kv``): the prompt is computed
    and kept in the model's dtype, and the first decode step converts the layer's values to this
    dtype and its keys to ``key_dtype`` (float16), which decode steps then read
    (:func:`dense_decode`: half the bytes, whatever the length: the embedded model's 1k step, 1032
    rows, read 47.6 MB of float32 rows beside 79.6 MB of weights). The keys take float16's 11
    significant bits rather than bfloat16's 8: the scores are what a rounding moves most (the
    embedded model, three 4k summaries of 64 tokens, teacher-forced agreement with the float
    model 182/186 with bfloat16 keys and values, 185/186 with bfloat16 values and float32 keys,
    186/186 float). A layer whose keys reach ``key_half_max`` keeps them in its dtype (float16
    ends at 65504). A prompt chunk that comes after that (a second question over a cropped
    cache) is handed float copies.

    ``clamp`` (a :class:`~.positions.RopeFrame`; a run whose prompt fits the model's trained
    context and whose generation goes past it, ``methods.all_dense``): a decode step attends to
    the keys farther than the trained context at the farthest trained distance, ``trained - 1``,
    instead of their true one (:meth:`clamped`); every other key keeps its true distance. The
    keys stay stored at their true positions."""

    min_capacity = 256
    key_dtype = torch.float16
    key_half_max = 8192.0  # larger keys stay in the model's dtype (float16's largest is 65504)
    clamp_ahead = 256  # keys un-rotated at once for ``clamp`` (the rows after this step's first few)

    def __init__(self, decode_dtype: torch.dtype | None = None, clamp=None):
        super().__init__()
        self.decode_dtype = decode_dtype
        self.clamp = clamp

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self._n = 0
        self._k0 = None  # the clamped keys un-rotated (float32, H, capacity, d): rows [0, _c0) valid
        self._c0 = 0

    def clamped(self, query: torch.Tensor):
        """For a decode step (its row already added; query (1, Hq, 1, d) at position ``n - 1``):
        None while every key is within the trained context, else ``(far_q (H, G, d), k0 (H, c,
        d))``: the ``c = n - trained`` oldest keys un-rotated (to position 0; once per key,
        ``clamp_ahead`` keys at a time) and the query turned from its position to ``trained -
        1``, so that ``far_q @ k0^T`` are those keys' scores at distance ``trained - 1`` (RoPE
        depends on the difference of positions)."""
        got = self.clamp_rows(self._n)
        if got is None:
            return None
        k0, turn = got
        far_q = torch.matmul(query[0, :, 0].float(), turn).view(k0.shape[0], -1, turn.shape[0])
        return far_q, k0

    def clamp_rows(self, rows: int):
        """For a decode step over ``rows`` rows (its own included; the rows before it held):
        None within the trained context, else ``(k0 (H, c, d), turn (d, d))``: the ``c = rows -
        trained`` oldest keys un-rotated and the rotation that turns the step's query to the
        farthest trained distance (:meth:`clamped`, whose query it turns; the fused layers turn
        theirs themselves)."""
        frame = self.clamp
        if frame is None or rows <= frame.trained:
            return None
        c = rows - frame.trained
        H, d = self._k.shape[1], self._k.shape[3]
        # the next keys to clamp, a block ahead: one key per step cost 3 ms per token at 8k
        # (30 layers); only rows the layer holds (a fused step writes its own row later)
        if self._c0 < c:
            upto = min(self._n, c + self.clamp_ahead)
            if self._k0 is None or self._k0.shape[1] < upto:
                grown = torch.empty((H, upto + self.clamp_ahead, d), dtype=torch.float32, device=self._k.device)
                if self._c0:
                    grown[:, : self._c0] = self._k0[:, : self._c0]
                self._k0 = grown
            rows_ = self._k[0, :, self._c0 : upto].float()
            self._k0[:, self._c0 : upto] = frame.rotate(rows_, torch.arange(self._c0, upto), 0)
            self._c0 = upto
        turn = frame.rotation_matrix(rows - 1, frame.trained - 1, d, str(self._k0.device))
        return self._k0[:, :c], turn

    def __getstate__(self):
        """A copy (a forked cache) leaves out the fused step's lists of this layer's buffers
        (``_fused_rows``, :func:`~icecache.fused_step.run_layers`; remade at the next step)."""
        state = self.__dict__.copy()
        state.pop("_fused_rows", None)
        return state

    def _reserve(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self._k is None else self._k.shape[2]
        if need <= cap:
            return
        new_cap = max(need + self.min_capacity, cap + cap // 8)
        B, H, _, dk = like_k.shape
        kd = like_k.dtype if self._k is None else self._k.dtype
        vd = like_v.dtype if self._v is None else self._v.dtype  # (a decode dtype, once taken, stays)
        k = torch.empty((B, H, new_cap, dk), dtype=kd, device=like_k.device)
        v = torch.empty((B, H, new_cap, like_v.shape[3]), dtype=vd, device=like_v.device)
        if self._n:
            k[:, :, : self._n] = self._k[:, :, : self._n]
            v[:, :, : self._n] = self._v[:, :, : self._n]
        self._k, self._v = k, v

    def take_decode_dtype(self) -> None:
        """Before a decode step: the layer's values converted to ``decode_dtype`` and its keys to
        ``key_dtype`` (where they fit), once (from then on its buffers keep those dtypes)."""
        if self.decode_dtype is not None and self._v.dtype != self.decode_dtype:
            self._v = self._v.to(self.decode_dtype)
            if float(self._k[:, :, : self._n].abs().max()) < self.key_half_max:
                self._k = self._k.to(self.key_dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if self._k is not None and key_states.shape[0] != self._k.shape[0]:
            raise ValueError("batch size changed within one cache")
        if q == 1:
            self.take_decode_dtype()
        self._reserve(self._n + q, key_states, value_states)
        self._k[:, :, self._n : self._n + q] = key_states
        self._v[:, :, self._n : self._n + q] = value_states
        self._n += q
        self.keys = self._k[:, :, : self._n]
        self.values = self._v[:, :, : self._n]
        if q > 1 and self._v.dtype != value_states.dtype:  # a prompt chunk attends in the model's dtype
            return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._n = max(0, self._n + tokens_to_remove)
        self._c0 = min(self._c0, self._n)  # un-rotated copies of rows that stay
        self.keys = self._k[:, :, : self._n]
        self.values = self._v[:, :, : self._n]

    def reset(self) -> None:
        self._k = self._v = None
        self._n = 0
        self._k0 = None
        self._c0 = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("GrowingLayer holds a fixed batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("GrowingLayer holds a fixed batch")

    def device_bytes(self) -> int:
        """Bytes the layer holds (its whole buffer, spare capacity included)."""
        if not self.is_initialized or self._k is None:
            return 0
        return int(self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size())


class DenseCache(Cache):
    """Every layer a :class:`GrowingLayer`: full attention without the per-step concatenation (a
    model's sliding-window layers: their window, :class:`~.window.WindowLayer`)."""

    def __init__(self, num_layers: int, decode_dtype: torch.dtype | None = None, windows: list[int] | None = None):
        super().__init__(layers=[window_or(windows, i, lambda: GrowingLayer(decode_dtype)) for i in range(num_layers)])

    def device_kv_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers)


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16; read from Linux's
    /proc/cpuinfo, False elsewhere): there ``prompt_compute: auto`` takes bfloat16 products (an 8k
    prompt 1.99x faster, docs/results.md, "Prefill")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _rows_buffer(t: torch.Tensor):
    """(H, n, d) whose rows are contiguous per head (a growing cache's view of its first n rows)
    as the C-contiguous (H, capacity, d) NumPy array it lies in; None if it is not laid out so."""
    H, n, d = t.shape
    sh, sr, sd = t.stride()
    if sd != 1 or sr != d or sh % d or sh < n * d:
        return None
    return torch.as_strided(t, (H, sh // d, d), (sh, d, 1)).numpy()


def kernel_rows(t: torch.Tensor):
    """:func:`_rows_buffer` as the numba kernels read it: float32 as it is, bfloat16 as its bits
    in uint16, float16 as its bits in int16 (:func:`~.score_kernels.widen`); None for other
    dtypes or layouts."""
    if t.dtype in (torch.bfloat16, torch.float16):
        bits = _rows_buffer(t.view(torch.int16))
        return None if bits is None else bits.view(np.uint16) if t.dtype == torch.bfloat16 else bits
    return _rows_buffer(t) if t.dtype == torch.float32 else None


def _clamp_scores(scores: torch.Tensor, clamp) -> None:
    """Replace the scores (H, G, T) of the first keys by their scores at the clamped distance
    (:meth:`GrowingLayer.clamped`'s ``(far_q, k0)``), in place; nothing if ``clamp`` is None."""
    if clamp is not None:
        far_q, k0 = clamp
        scores[:, :, : k0.shape[1]] = torch.matmul(far_q, k0.transpose(1, 2))


def dense_decode(query, key, value, scaling, clamp=None, softcap=None):
    """One query token over a dense cache: each KV head's keys and values are read once, its
    group of query heads in one matrix product (no per-query-head expansion; SDPA's CPU kernel
    took 58 vs 37 ms per layer at 131k tokens). query (1, Hq, 1, d); key, value (1, H, T, d)
    -> (1, 1, Hq, d). Softmax in float32. The reference is :func:`icecache.cache.paged.paged_decode_reference` with
    every row valid. ``clamp``: the oldest keys at a clamped distance (:meth:`GrowingLayer.clamped`).
    A float32 query on the CPU, keys in float32 or float16 and values in float32 or bfloat16
    (``GrowingLayer.decode_dtype``), rows lying in a growing buffer: the whole step in one numba
    call (:func:`~.score_kernels.dense_decode_fused`); the others (and the reference of that
    path) :func:`dense_decode_reference`'s matrix products. ``softcap`` (Gemma 2): the scaled scores
    capped (:func:`~.chunked.soft_cap`) before the softmax."""
    Hq, d = query.shape[1], query.shape[3]
    H = key.shape[1]
    q = query[0, :, 0].reshape(H, Hq // H, d)
    T = key.shape[2]
    if (key.device.type == "cpu" and query.dtype == torch.float32 and key.dtype in (torch.float32, torch.float16)
            and value.dtype in (torch.float32, torch.bfloat16)):
        k, v = kernel_rows(key[0]), kernel_rows(value[0])
        far = None if clamp is None else (clamp[0].detach().contiguous().numpy(), _rows_buffer(clamp[1]))
        if k is not None and v is not None and (far is None or far[1] is not None):
            from .score_kernels import dense_decode_fused

            qn = q.detach().contiguous().numpy()
            far_q, k0, c = (qn, np.zeros((H, 0, d), np.float32), 0) if far is None else (far[0], far[1], clamp[1].shape[1])
            out = torch.empty((H, Hq // H, d), dtype=torch.float32)
            dense_decode_fused(qn, k, v, T, np.float32(scaling), np.float32(softcap or 0.0), far_q, k0, c,
                               out.numpy())
            return out.reshape(1, 1, Hq, d)
    return dense_decode_reference(query, key, value, scaling, clamp, softcap)


def dense_decode_reference(query, key, value, scaling, clamp=None, softcap=None):
    """:func:`dense_decode` by matrix products alone (no numba): each KV head's group of query
    heads against its keys in one product. The path of short caches and of other devices or
    dtypes, and the reference the numba scores are tested against. Same shapes as
    :func:`dense_decode`; keys and values in the query's dtype or 16 bits (keys widened to the
    query's, the probabilities meet the values in theirs)."""
    Hq, d = query.shape[1], query.shape[3]
    H = key.shape[1]
    q = query[0, :, 0].reshape(H, Hq // H, d)
    scores = torch.matmul(q, key[0].transpose(-1, -2).to(q.dtype)).float()  # (H, G, T)
    _clamp_scores(scores, clamp)
    probs = torch.softmax(soft_cap(scores.mul_(scaling), softcap), dim=-1).to(value.dtype)
    return torch.matmul(probs, value[0]).to(query.dtype).reshape(1, 1, Hq, d)


def dense_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``dense`` method's attention: :func:`dense_decode` for a decode step of one
    unpadded sequence, transformers' SDPA otherwise (:func:`.chunked.sdpa_forward`); either
    caps the scores where the model passes a ``softcap``."""
    if query.shape[0] == 1 and query.shape[2] == 1 and attention_mask is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return dense_decode(query, key, value, scale, softcap=kwargs.get("softcap")), None
    return sdpa_forward(module, query, key, value, attention_mask, scaling=scaling,
                        dropout=dropout, **kwargs)


def windowed_dense(query, key, value, sink: int, window: int, scaling, frame=None, softcap=None):
    """Sparse prefill in a dense layer: the chunk attends to the first ``sink`` tokens and the
    ``window`` tokens before it (plus itself, causally), not to the whole prefix.

    query (1, Hq, C, d); key, value (1, H, n, d) with the chunk as the last C rows. ``frame``
    (positions remapped, :mod:`.positions`): the sink keys are rotated to sit just before the
    window instead of at their true distance. ``softcap``: capped scores (explicit products on
    any device: SDPA cannot cap).
    """
    import torch.nn.functional as F

    C, n = query.shape[2], key.shape[2]
    w0 = n - C - window
    if w0 <= sink:
        return None  # the whole prefix fits: ordinary causal attention
    sink_k = key[:, :, :sink]
    if frame is not None:
        sink_k = frame.rotate(sink_k, torch.arange(sink), torch.arange(sink) + w0 - sink)
    k = torch.cat([sink_k, key[:, :, w0:]], dim=2)
    v = torch.cat([value[:, :, :sink], value[:, :, w0:]], dim=2)
    if query.device.type == "cpu":  # the same pattern: the chunk sees sink + window, then itself causally
        return prefix_causal(query, k, v, scaling, softcap).transpose(1, 2).contiguous()
    if softcap:
        return prefix_causal_half(query, k, v, scaling, query.dtype, softcap=softcap).transpose(1, 2).contiguous()
    L = k.shape[2]
    mask = torch.ones(C, L, dtype=torch.bool, device=query.device)
    mask[:, sink + window :] = torch.ones(C, C, dtype=torch.bool, device=query.device).tril()
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask[None, None], scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()
