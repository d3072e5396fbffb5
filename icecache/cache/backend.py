"""Where resident pages live and how pages get there: one interface, a torch implementation.

The cache manager only talks to a :class:`Backend`: allocate the fixed device page pool, keep the
host store, and move a set of host rows into pool slots in one gather + one copy + one scatter.

- On CPU the "device" pool is a fixed-size host tensor with the same accounting, so every code
  path of the manager runs and is tested here.
- On CUDA the host store is pinned, rows are gathered into a pinned staging buffer, copied with
  ``non_blocking`` on a dedicated copy stream and scattered into the pool after the compute
  stream waits for the copy (``TorchBackend`` does both; the CUDA branch is exercised by the
  GPU parity tests, skipped without a GPU).
- FlashInfer's paged decode is an optional fast path on CUDA (``attention``: the profile's
  ``attention_backend``; :mod:`.flashinfer_decode`); the torch attention of :mod:`.paged` is its
  reference, and the path every step takes where FlashInfer does not apply.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import torch

from ..errors import UsageError


def flashinfer_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


class TorchBackend:
    """Pool, host store and page loading with plain torch ops, on CPU or CUDA."""

    # On CUDA the stage timers of a decode step (load, attention) read host clocks around
    # asynchronous work; a benchmark sets this to synchronize at each stage's end so that the
    # breakdown is the device's time (it costs the overlap between stages).
    sync_timers = False

    def __init__(self, device: torch.device | str, attention: str = "auto"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: dict[tuple, torch.Tensor] = {}
        self._copied = None  # CUDA event: the last copy out of the staging buffer finished
        if attention == "flashinfer" and not flashinfer_available(self.device):
            raise UsageError("attention_backend: flashinfer needs a CUDA device and the flashinfer "
                             "package (pip install flashinfer-python)")
        # whether decode steps go through FlashInfer's kernel (False: torch's attention)
        self.flashinfer = attention != "torch" and flashinfer_available(self.device)
        self._decoders: dict[int, object] = {}
        self._flashinfer_ran = False

    # -- attention -------------------------------------------------------------------------------
    def decode_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         valid: np.ndarray, scaling: float, softcap: float | None = None) -> torch.Tensor | None:
        """One decode step's attention of layer ``layer`` through FlashInfer: q (H, G, d) over the
        valid rows (``valid``: (H, L) on the host) of k, v (H, L, d) -> (H, G, d); None where it
        does not apply (torch's attention then). A kernel that fails at its first call (say, its
        compile) turns the path off for this cache, with one line on stderr."""
        if not self.flashinfer:  # every CPU step: nothing more to look at
            return None
        from . import flashinfer_decode as fi

        if not fi.usable(q, k, softcap):
            return None
        try:
            decoder = self._decoders.get(layer)
            if decoder is None:
                decoder = self._decoders[layer] = fi.FlashInferDecode(self.device)
            out = decoder(q, k, v, valid, scaling)
        except Exception as exc:  # noqa: BLE001 - any failure of the optional kernel's first call
            if self._flashinfer_ran:
                raise
            self.flashinfer = False
            print(f"icecache: FlashInfer's decode failed ({type(exc).__name__}: {str(exc)[:160]}); "
                  "torch attention instead", file=sys.stderr)
            return None
        self._flashinfer_ran = True
        return out

    # -- memory ------------------------------------------------------------------------------
    def device_zeros(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def host_empty(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        return t.pin_memory() if self.cuda else t

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor (pinned on CUDA)."""
        out = self.host_empty(tuple(t.shape), t.dtype)
        out.copy_(t, non_blocking=False)
        return out

    def _stage(self, rows: int, dim: int, dtype) -> torch.Tensor:
        key = (dim, dtype)
        buf = self._staging.get(key)
        if buf is None or buf.shape[0] < rows:
            size = max(rows, 256)
            buf = torch.empty((size, dim), dtype=dtype, pin_memory=self.cuda)
            self._staging[key] = buf
        return buf[:rows]

    # -- page loading ---------------------------------------------------------------------------
    def load_rows(self, host_k: torch.Tensor, host_v: torch.Tensor, src: torch.Tensor,
                  pool_k: torch.Tensor, pool_v: torch.Tensor, dst: torch.Tensor) -> int:
        """Copy host rows into pool rows; return the bytes moved.

        ``host_k``/``host_v``: (R, d) host rows (all KV heads' stores flattened); ``src``: (m,)
        int64 row ids into them; ``pool_k``/``pool_v``: (Q, d) flattened pool rows on the
        device; ``dst``: (m,) int64 row ids into the pool. One gather into a staging buffer,
        one host-to-device copy per tensor, one scatter.
        """
        m = int(src.numel())
        if m == 0:
            return 0
        d = host_k.shape[1]
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffer is free again
        stage = self._stage(2 * m, d, host_k.dtype)
        torch.index_select(host_k, 0, src, out=stage[:m])
        torch.index_select(host_v, 0, src, out=stage[m:])
        if not self.cuda:
            pool_k.index_copy_(0, dst, stage[:m].to(pool_k.dtype))  # a host store in float16
            pool_v.index_copy_(0, dst, stage[m:].to(pool_v.dtype))
        else:
            current = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_stream(current)
                moved = stage.to(self.device, non_blocking=True)
                dst_dev = dst.to(self.device, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
            current.wait_stream(self._stream)
            moved.record_stream(current)
            dst_dev.record_stream(current)
            pool_k.index_copy_(0, dst_dev, moved[:m].to(pool_k.dtype))
            pool_v.index_copy_(0, dst_dev, moved[m:].to(pool_v.dtype))
        return 2 * m * d * host_k.element_size()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timer_sync(self) -> None:
        """Before a stage timer is read: wait for the device when ``sync_timers`` is set."""
        if self.cuda and self.sync_timers:
            torch.cuda.synchronize(self.device)
