"""Positions the model knows: re-rotating RoPE keys and queries.

A model trained on ``trained`` positions has never seen a query-key distance beyond that, so a
long document's far tokens must not be attended at their true distance. With ``positions:
remap`` every attended token gets a distance inside the trained range (InfLLM's and
StreamingLLM's idea, on IceCache's pages):

- the recent window (and a prefill chunk) at its true distance;
- the rows brought back from the host store just beyond the window, per KV head in token order,
  one position each (InfLLM puts them all at one distance);
- the sink tokens at their own positions, just before those rows.

With every page loaded these are the true positions: remapped ice then equals full attention.

RoPE rotates each pair of channels by ``position x inv_freq``, and rotations compose: a key
rotated at position ``a`` becomes the key at ``b`` by one more rotation by ``b - a`` with the same
inverse frequencies (Llama 3, YaRN and linear scaling only change the frequencies; YaRN's
attention scaling multiplies cos and sin once and is not applied again). So offloaded keys are
stored un-rotated (a position-free frame, which the index searches too); a decode step rotates
a copy of the resident sink and pool rows to their places (:func:`place_keys`, one rotation;
the resident rows themselves never change) and attends with its query at its true position, as
a sparse-prefill chunk does. :func:`remap_decode` is the plain reference (a query per region).

Angles are computed as transformers computes them (float32 ``position x inv_freq``), and a
rotation from ``a`` to ``b`` uses the float64 difference of those angles, so un-rotating a key
inverts the model's own rotation to float rounding at any position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .chunked import soft_cap
from .dense import GrowingLayer

MODES = ("auto", "true", "remap")
TABLE_AHEAD = 256  # RopeFrame's rotation tables: positions made above a step's, for the steps after it
COMPOSABLE = ("default", "linear", "llama3", "yarn")  # rope types whose frequencies are fixed


@dataclass(frozen=True)
class RopeFrame:
    """The model's RoPE: ``inv_freq`` (rotary_dim / 2,) float32, the trained context length."""

    inv_freq: torch.Tensor
    trained: int
    rope_type: str = "default"

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    @staticmethod
    def from_model(model) -> RopeFrame | None:
        """The frame of ``model``'s rotary embedding (None if it has none)."""
        # A model with one RoPE per layer kind (Gemma 3: window layers and global layers) keeps
        # each kind's frequencies as "<kind>_inv_freq"; positions are remapped in the global
        # (full-attention) layers only, so theirs is the frame.
        prefix = ""
        rot = next((m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)), None)
        if rot is None:
            prefix = "full_attention_"
            rot = next((m for m in model.modules()
                        if isinstance(getattr(m, prefix + "inv_freq", None), torch.Tensor)), None)
        if rot is None:
            return None
        cfg = model.config
        params = getattr(cfg, "rope_parameters", None) or {}
        if "rope_type" not in params and isinstance(next(iter(params.values()), None), dict):
            params = params.get("full_attention", {})  # per-layer-type parameters: the global layers'
        rope_type = params.get("rope_type", getattr(rot, "rope_type", "default"))
        trained = int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        inv = getattr(rot, prefix + "original_inv_freq", None) if rope_type == "dynamic" else None
        inv = getattr(rot, prefix + "inv_freq") if inv is None else inv
        return RopeFrame(inv.detach().float().cpu().clone(), trained, rope_type)

    @property
    def composable(self) -> bool:
        return self.rope_type in COMPOSABLE

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """(n,) positions -> (n, rotary_dim / 2) angles, as the model computes them (float32)."""
        return positions.float()[:, None] * self.inv_freq[None, :]

    def rotation(self, src, dst, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, rotary_dim) of the rotation taking positions ``src`` to ``dst``
        (ints or (n,) tensors, broadcast)."""
        src = torch.as_tensor(src, dtype=torch.int64).reshape(-1)
        dst = torch.as_tensor(dst, dtype=torch.int64).reshape(-1)
        n = max(len(src), len(dst))
        a = self.angles(src.expand(n)).double()
        b = self.angles(dst.expand(n)).double()
        delta = torch.cat([b - a, b - a], dim=-1)
        return delta.cos().to(device), delta.sin().to(device)

    def rotate(self, x: torch.Tensor, src, dst) -> torch.Tensor:
        """``x`` (..., n, head_dim) rotated from positions ``src`` to ``dst`` (per row or one
        for all rows); channels past ``rotary_dim`` are left as they are."""
        if isinstance(src, int) and isinstance(dst, int):  # one rotation for all: every layer of a step
            if x.dtype == torch.float32 and x.device.type == "cpu":  # a decode step's queries: a few rows
                return torch.from_numpy(self._turn(x.numpy(), src, dst))
            if x.dtype == torch.float32:  # one product (a decode step's queries: 30 us of ops a layer before)
                return x @ self.rotation_matrix(src, dst, x.shape[-1], str(x.device))
            cos, sin = self._one_rotation(src, dst, str(x.device))
        else:
            cos, sin = self.rotation(src, dst, x.device)
        return self.rotate_by(x, cos, sin)

    def rotate_run(self, x: torch.Tensor, first: int, dst: int) -> torch.Tensor:
        """:meth:`rotate` of ``x`` (..., n, head_dim) from positions ``first`` to ``first + n - 1``
        (row by row) to ``dst``, the rotation made once for the calls that ask the same (a decode
        step's evicted page: the same positions in every layer, whose 28 rotations of the same
        angles took some 300 us a layer of the step that sheds it)."""
        cos, sin = self._run_rotation(first, x.shape[-2], dst, str(x.device))
        return self.rotate_by(x, cos, sin)

    @functools.lru_cache(maxsize=4)  # noqa: B019  (the layers of one decode step share it)
    def _run_rotation(self, first: int, n: int, dst: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotation(torch.arange(first, first + n), dst, device)

    def _turn(self, x: np.ndarray, src: int, dst: int) -> np.ndarray:
        """:meth:`rotate` of float32 rows ``x`` (..., head_dim) in NumPy (a copy)."""
        cos, sin = self._one_arrays(src, dst)
        r, half = self.rotary_dim, self.rotary_dim // 2
        out = np.array(x, np.float32)
        a, b = x[..., :half], x[..., half:r]
        out[..., :half] = a * cos[:half] - b * sin[:half]
        out[..., half:r] = b * cos[half:] + a * sin[half:]
        return out

    @functools.lru_cache(maxsize=16)  # noqa: B019  (the layers of one decode step share it)
    def _one_rotation(self, src: int, dst: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._one_arrays(src, dst)
        return torch.from_numpy(cos[None]).to(device), torch.from_numpy(sin[None]).to(device)

    @functools.lru_cache(maxsize=16)  # noqa: B019  (the layers of one decode step share it)
    def _one_arrays(self, src: int, dst: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`rotation` of one pair of positions as float32 NumPy arrays (rotary_dim,), the
        same angles in NumPy: a step's query turns by a rotation of its own in every layer
        (Gemma 3's estimate rows: the pool's farthest row differs by layer), where torch's ops
        took about 80 us and a rotation matrix from them 100 more."""
        inv = self.inv_freq.numpy()
        delta = (np.float32(dst) * inv).astype(np.float64) - (np.float32(src) * inv).astype(np.float64)
        delta = np.concatenate([delta, delta])
        return np.cos(delta).astype(np.float32), np.sin(delta).astype(np.float32)

    @functools.lru_cache(maxsize=4)  # noqa: B019  (the layers of one decode step share it)
    def rotation_matrix(self, src: int, dst: int, head_dim: int, device: str = "cpu") -> torch.Tensor:
        """(head_dim, head_dim) float32 ``M`` on ``device`` with ``x @ M`` = :meth:`rotate` ``(x,
        src, dst)`` (channels past ``rotary_dim`` kept): one product instead of a rotation's
        several ops."""
        cos, sin = self._one_arrays(src, dst)
        r, half = self.rotary_dim, self.rotary_dim // 2
        m = np.eye(head_dim, dtype=np.float32)
        j = np.arange(r)
        m[j, j] = cos
        m[j[:half] + half, j[:half]] = -sin[:half]
        m[j[half:] - half, j[half:]] = sin[half:]
        return torch.from_numpy(m).to(device)

    def down_table(self, top: int, n: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, rotary_dim) float32 on ``device`` of the rotations from position 0 to
        ``top``, ``top - 1``, ..., ``top - n + 1``: views of :meth:`_descending`'s table."""
        first, cos, sin, _arrays = self._descending(top, n, device)
        at = first - top
        return cos[at : at + n], sin[at : at + n]

    def down_arrays(self, top: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`down_table` on the CPU as NumPy arrays (as the CPU kernels take it)."""
        first, _cos, _sin, (cos, sin) = self._descending(top, n, "cpu")
        at = first - top
        return cos[at : at + n], sin[at : at + n]

    def _descending(self, top: int, n: int, device: str) -> tuple:
        """A table of the rotations from 0 to ``first``, ``first - 1``, ... on ``device`` that holds
        ``top`` down to ``top - n + 1``: (first, cos, sin, the CPU's as NumPy arrays or None).

        A row depends on its position only, and a decode step's ``top`` (where the pages end)
        moves up by one a token: the table is made with :data:`TABLE_AHEAD` positions above
        ``top`` and as many rows more below, and serves every step until ``top`` passes its first
        row or a step needs rows below its last. Remade every step, Gemma 3's tables (rotary 256,
        a few thousand rows where pinned passages sit a gap away) took about 6 ms a token."""
        tables = self.__dict__.get("_tables")
        if tables is None:
            tables = {}
            object.__setattr__(self, "_tables", tables)  # (a cache, not a field: frozen, and not saved)
        held = tables.get(device)
        if held is None or top > held[0] or held[0] - top + n > held[1].shape[0]:
            first = top + TABLE_AHEAD
            rows = n + 2 * TABLE_AHEAD if held is None else max(n + 2 * TABLE_AHEAD, held[1].shape[0])
            cos, sin = self.rotation(0, first - torch.arange(rows), device)
            cos, sin = cos.float(), sin.float()
            arrays = (cos.numpy(), sin.numpy()) if cos.device.type == "cpu" else None
            held = tables[device] = (first, cos, sin, arrays)
        return held

    def rotate_by(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` (..., head_dim) rotated by the angles whose cos and sin (..., rotary_dim) are
        given (broadcast)."""
        r = self.rotary_dim
        head = x[..., :r].float()
        half = r // 2
        turned = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
        out = (head * cos + turned * sin).to(x.dtype)
        return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


def choose(mode: str, frame: RopeFrame | None, tokens: int) -> str:
    """``true`` or ``remap`` for a run of ``tokens`` (prompt + generation): ``auto`` remaps only
    when the run goes past the trained context and the model's RoPE composes."""
    if mode not in MODES:
        raise ValueError(f"positions must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "true":
        return "true"
    if frame is None or not frame.composable:
        if mode == "remap":
            what = "no rotary embedding" if frame is None else f"RoPE type '{frame.rope_type}'"
            raise ValueError(f"positions: remap needs a RoPE whose frequencies are fixed; this model has {what}")
        return "true"
    if mode == "remap":
        return "remap"
    return "remap" if tokens > frame.trained else "true"


@dataclass(frozen=True)
class Remap:
    """The remap rule of an ice cache: distances for pages (``page_distance``) and sink."""

    frame: RopeFrame
    # where pages from the host store sit: just beyond the window, the loaded rows of a head in
    # token order from there on (one position each, the nearest first; :func:`ordered_offsets`),
    # and no nearer than ``page_distance``: the model's largest sliding window (0: none). Such a
    # model's global layers were trained beside window layers that see every token that near,
    # and Gemma 3's did not take a needle placed within its 512-token window (docs/results.md,
    # "Gemma 3 270M past its trained context")
    page_distance: int
    # with pinned answer passages: the other pool rows (and the sink) sit ``pin_gap`` positions
    # farther back than the passages, as far as the trained context allows
    pin_gap: int = 0

    def pages_end(self, length: int, window_fill: int) -> int:
        """The position the loaded pages end at in a step of a layer holding ``length`` tokens
        (the step's own included) whose window holds ``window_fill`` of them."""
        return length - 1 - max(window_fill, self.page_distance)

    def query_regions(self, q: torch.Tensor, pos: int, sink_distance, distance: int) -> torch.Tensor:
        """A decode step's query heads ``q`` (heads, G, d) at true position ``pos`` -> (3, heads,
        G, d): the query for the sink rows (sink token ``j`` at distance ``sink_distance - j``;
        an int or one per head), for the pool rows (un-rotated keys, at ``distance``), for the
        window rows (true distances)."""
        flat = q.reshape(-1, q.shape[-1])
        group = q.shape[-2]
        sink_at = torch.as_tensor(sink_distance, dtype=torch.int64).reshape(-1, 1)
        sink_q = self.frame.rotate(flat, pos, sink_at.expand(q.shape[0], group).reshape(-1))
        pool_q = self.frame.rotate(flat, pos, distance)
        return torch.stack([sink_q.reshape(q.shape), pool_q.reshape(q.shape), q])


def place_keys(frame: RopeFrame, k: torch.Tensor, sink_fill: int, pool_at: int, window_at: int,
               pages_at: int, offset: torch.Tensor, count: torch.Tensor, fast: bool = True) -> torch.Tensor:
    """A copy of resident keys ``k`` (H, L, d) with the pool rows (stored un-rotated) placed to
    end at position ``pages_at``, row ``i`` of a head at ``pages_at - offset[h, i]``, and the sink
    (stored at its true positions) just before the head's ``count[h]`` pool positions; the window
    rows (from ``window_at``) as they are.

    No trigonometry per row: every moved row turns by a row of :meth:`RopeFrame.down_table`
    (rotations from 0 to ``pages_at - i``, shared by the layers of a step): a pool row by row
    ``offset``, a head's sink rows by row ``count + sink_fill - 1`` (from token ``j`` to
    ``pages_at - count - sink_fill + 1 + j``).

    ``fast``: float32 keys on the CPU turn in one numba pass (:func:`~.kernels.place_rows`);
    otherwise (and as its reference) torch ops."""
    H, _, d = k.shape
    if fast and k.device.type == "cpu" and k.dtype == torch.float32:
        from .kernels import place_rows

        return torch.from_numpy(place_rows(k.contiguous().numpy(),
                                           *place_tables(frame, sink_fill, pool_at, window_at, pages_at, offset, count)))
    idx = torch.empty(H, window_at, dtype=torch.int64)
    idx[:, :pool_at] = (count.to(torch.int64) + sink_fill - 1)[:, None]
    idx[:, pool_at:] = offset
    need = int(idx.max()) + 1 if idx.numel() else 0
    cos_t, sin_t = frame.down_table(int(pages_at), table_rows(need, window_at), str(k.device))
    flat = idx.view(-1).to(k.device)
    r = cos_t.shape[1]
    cos, sin = cos_t.index_select(0, flat).view(H, window_at, r), sin_t.index_select(0, flat).view(H, window_at, r)
    moved = frame.rotate_by(k[:, :window_at], cos, sin)
    return torch.cat([moved, k[:, window_at:]], dim=1)


def place_tables(frame: RopeFrame, sink_fill: int, pool_at: int, window_at: int, pages_at: int,
                 offset: torch.Tensor, count: torch.Tensor) -> tuple:
    """:func:`place_keys`'s placement as the CPU kernels take it (:func:`~.kernels.place_rows`,
    :func:`~.score_kernels.paged_decode_fused`): offsets (H, P) and counts (H,) int64, the
    sink fill, the pool's first row, the cos and sin tables (R, rotary) float32, rotary."""
    off, cnt = offset.numpy(), count.numpy().astype(np.int64, copy=False)
    need = max(int(cnt.max()) + sink_fill - 1 if pool_at else 0, int(off.max()) if off.size else 0) + 1
    cos_t, sin_t = frame.down_arrays(int(pages_at), table_rows(need, window_at))
    return off, cnt, sink_fill, pool_at, cos_t, sin_t, frame.rotary_dim


def table_rows(need: int, window_at: int) -> int:
    """Rows of the rotation table for a step: one per slot, more (in whole 1024s) for the
    positions that gaps between rows take; the same for the layers of a step (one table)."""
    return window_at + 1 if need <= window_at + 1 else -(-need // 1024) * 1024


def ordered_offsets(rows, valid, top: int = 0, keep: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ordered_offsets_reference` by one numba pass per head
    (:func:`~.kernels.ordered_offsets_nb`)."""
    from .kernels import ordered_offsets_nb

    offset, span = ordered_offsets_nb(np.asarray(rows, np.int64), np.asarray(valid, np.bool_),
                                      int(top), int(keep))
    return torch.from_numpy(offset), torch.from_numpy(span)


def ordered_offsets_reference(rows, valid, top: int = 0, keep: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows in token order: ``rows`` (H, n) host-store rows of the pool slots (the store
    appends in token order, so rows order tokens), ``valid`` (H, n) bool (NumPy). Returns
    (offset (H, n): the row's distance before the head's latest valid row, which is at 0;
    positions the head's valid rows span (H,)).

    Two rows next to each other in token order are one position apart, whatever lies between
    them. Invalid rows get offsets past the span (they are masked).

    ``keep``: rows at most ``keep`` rows before host row ``top`` (the row whose offset 0 is its
    true place) keep their true offset ``top - row``, and the rows beyond them follow one
    position apart (-1: none kept, the nearest row at 0). If ``keep`` reaches past row 0 (the
    whole store is kept), the span is ``top + 1``: the sink, placed just beyond it, is at its
    true positions too."""
    key = np.where(valid, rows, -1)
    order = np.argsort(key, axis=1, kind="stable")
    H, n = key.shape
    srt = np.take_along_axis(key, order, axis=1)  # invalid (-1) first, then rows ascending
    kept = (srt >= 0) & (srt <= top) & (top - srt <= keep)  # at their true offset
    diff = np.diff(srt, axis=1)
    step = np.where(kept[:, :-1], diff, np.minimum(diff, 1))  # distance to the next row in token order
    step[srt[:, :-1] < 0] = 1  # from an invalid row: one position (they lie past the span)
    after = np.zeros((H, n), np.int64)  # distance of each sorted row before the last one
    if n > 1:
        after[:, :-1] = np.cumsum(step[:, ::-1], axis=1)[:, ::-1]
    after += np.where(kept[:, -1:], top - srt[:, -1:], 0)  # the nearest row: true offset if kept
    offset = np.empty_like(after)
    np.put_along_axis(offset, order, after, axis=1)
    count = valid.sum(1)
    first = np.where(count > 0, after[np.arange(H), n - np.maximum(count, 1)], -1)
    span = first + 1
    if keep >= top >= 0:  # every row kept: the sink just beyond them is at its true place
        span[:] = top + 1
    return torch.from_numpy(offset), torch.from_numpy(span)


def remap_decode(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                 pool_at: int, window_at: int, scaling: float, pool_keys: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """One decode step with a query per region: qs (3, H, G, d) for rows [0, pool_at) (sink),
    [pool_at, window_at) (pool; ``pool_keys`` instead of those rows of ``k`` if given) and
    [window_at, L) (window); k, v (H, L, d); valid (H, L) -> (H, G, d). Softmax over all regions
    at once, in float32."""
    keys = [k[:, :pool_at], k[:, pool_at:window_at] if pool_keys is None else pool_keys, k[:, window_at:]]
    values = [v[:, :pool_at], v[:, pool_at:window_at], v[:, window_at:]]
    return attend_regions(list(zip(qs, keys, values, strict=True)), valid, scaling, softcap)


def attend_regions(regions, valid: torch.Tensor | None, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of one decode step whose key rows come in regions, each with its own query:
    ``regions`` = [(q (H, G, d), k (H, n_i, d), v (H, n_i, d)), ...] (views, not copied);
    ``valid`` (H, sum n_i) or None (all rows) -> (H, G, d). One softmax over every region, in
    float32 (``softcap``: of the capped scores, :func:`~.chunked.soft_cap`)."""
    scores = torch.cat([torch.einsum("hgd,hld->hgl", q.float(), k.float()) for q, k, _ in regions], dim=-1)
    scores = soft_cap(scores * scaling, softcap)
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out, at = None, 0
    for *_, v in regions:
        n = v.shape[1]
        part = torch.einsum("hgl,hld->hgd", probs[..., at : at + n], v.float())
        out = part if out is None else out + part
        at += n
    return out.to(regions[0][0].dtype)


class RemapDenseLayer(GrowingLayer):
    """A dense layer of the ice cache with remapped positions: a decode step attends to the last
    ``window`` tokens at their true distance and to the sink tokens just before them, as the
    sparse prefill's dense layers do (:func:`~.dense.windowed_dense`). Older tokens stay in the
    layer (``dense_kv`` gives them back) but are not attended: put all at one distance, thousands
    of them drowned the window's attention (a 16k passkey failed that way)."""

    def __init__(self, remap: Remap, sink: int, window: int):
        super().__init__()
        # the window at true distances stays well inside the trained context
        self.remap, self.sink, self.window = remap, sink, min(window, remap.frame.trained // 2)

    def attend(self, query: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
        """A decode step: query (1, Hq, 1, d) at position ``length - 1`` -> (1, 1, Hq, d)
        (``softcap``: the model's cap on its scores)."""
        n = self._n
        sink = min(self.sink, n)
        start = max(sink, n - self.window)  # the window's first row
        H, d = self._k.shape[1], query.shape[-1]
        q = query[0, :, 0].reshape(H, -1, d)
        k, v = self.keys[0], self.values[0]
        window = n - start  # this step's token included
        # the sink just before the window: its query rotated to that distance (one rotation
        # for every layer of the step), the window's query as it is
        sink_q = self.remap.frame.rotate(q.reshape(-1, d), n - 1, window + sink - 1).reshape(q.shape)
        out = self._fused(q, sink_q, sink, start, scale, softcap)
        if out is None:
            out = attend_regions([(sink_q, k[:, :sink], v[:, :sink]), (q, k[:, start:], v[:, start:])],
                                 None, scale, softcap)
        return out.reshape(1, 1, -1, d)

    def _fused(self, q: torch.Tensor, sink_q: torch.Tensor, sink: int, start: int, scale: float,
               softcap: float | None) -> torch.Tensor | None:
        """:meth:`attend`'s two regions in one numba call on the CPU (the dense decode's kernel,
        its first rows the sink's: :func:`~.score_kernels.dense_decode_fused`'s ``v0`` and
        ``shift``): (H, G, d), or None where it does not apply (another device or dtype; the
        regions' products, :func:`attend_regions`, are its reference)."""
        from .dense import kernel_rows

        if q.device.type != "cpu" or q.dtype != torch.float32:
            return None
        kb, vb = kernel_rows(self.keys[0]), kernel_rows(self.values[0])
        if kb is None or vb is None:
            return None
        from .score_kernels import dense_decode_fused

        out = torch.empty(q.shape, dtype=torch.float32)
        k0, v0 = np.ascontiguousarray(kb[:, :sink]), np.ascontiguousarray(vb[:, :sink])
        dense_decode_fused(q.contiguous().numpy(), kb, vb, sink + self._n - start, np.float32(scale),
                           np.float32(softcap or 0.0), sink_q.contiguous().numpy(), k0, sink, out.numpy(), v0,
                           start - sink)
        return out

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (1, H, n, d) at their true positions (a copy)."""
        return self.keys.clone(), self.values.clone()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a remapped dense layer cannot be cut back")
