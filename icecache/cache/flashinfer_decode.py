"""FlashInfer's paged decode attention over an ice layer's resident rows (CUDA; optional).

A layer's pool holds each KV head's rows (sink, the selected pages, window) with a validity mask,
and each KV head selects its own pages. A FlashInfer request shares one page list between its
KV heads, so here every KV head is a request of its own: its G query heads against one KV head,
whose pages are the head's valid rows, one row a page (page size 1: a partly filled page or a
hole in the mask needs no padding). The lists are made on the host from the mask at each step
(:func:`page_lists`); the tests check them on the CPU with :func:`attend_lists`, which reads the
same lists in plain torch, against :func:`~.paged.paged_decode_reference`, and the kernel against
the same reference on a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

WORKSPACE_BYTES = 128 << 20  # the kernels' scratch (split-KV partial results; FlashInfer's advised size), shared by the layers


def page_lists(valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """valid (H, L) -> (indptr (H + 1,), indices), int32: request (KV head) h's pages are
    ``indices[indptr[h]:indptr[h + 1]]``, the rows ``h * L + l`` of its valid ``l`` in order
    (the pool's keys seen as H * L pages of one row)."""
    indptr = np.zeros(valid.shape[0] + 1, np.int32)
    np.cumsum(valid.sum(axis=1), out=indptr[1:])
    return indptr, np.flatnonzero(valid).astype(np.int32)


def attend_lists(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indptr: np.ndarray, indices: np.ndarray,
                 scaling: float) -> torch.Tensor:
    """What the kernel computes from :func:`page_lists`, in plain torch (float32): q (H, G, d)
    over the rows ``indices`` of k, v seen as (H * L, d) -> (H, G, d)."""
    H, G, d = q.shape
    rows_k, rows_v = k.reshape(-1, d).float(), v.reshape(-1, d).float()
    out = torch.empty(H, G, d, dtype=torch.float32, device=q.device)
    for h in range(H):
        rows = torch.from_numpy(indices[indptr[h] : indptr[h + 1]].astype(np.int64)).to(q.device)
        probs = torch.softmax(q[h].float() @ rows_k[rows].T * scaling, dim=-1)
        out[h] = probs @ rows_v[rows]
    return out.to(q.dtype)


def usable(q: torch.Tensor, k: torch.Tensor, softcap: float | None) -> bool:
    """Whether the kernel takes this step: CUDA, 16-bit queries and rows of one dtype, no cap
    on the scores (the capped attention stays torch's)."""
    return (q.device.type == "cuda" and not softcap and q.dtype in (torch.float16, torch.bfloat16)
            and k.dtype == q.dtype)


_workspaces: dict[torch.device, torch.Tensor] = {}


class FlashInferDecode:
    """One layer's FlashInfer decode wrapper (its own plan buffers: a layer plans while an
    earlier layer's work may still be queued), the kernels' scratch shared by all layers (the
    kernels run in stream order)."""

    def __init__(self, device: torch.device):
        import flashinfer

        ws = _workspaces.get(device)
        if ws is None:
            ws = _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.device = device
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: np.ndarray,
                 scaling: float) -> torch.Tensor:
        """q (H, G, d), k, v (H, L, d) on the device, valid (H, L) on the host -> (H, G, d)."""
        H, G, d = q.shape
        indptr, indices = page_lists(valid)
        self.wrapper.plan(torch.from_numpy(indptr), torch.from_numpy(indices).to(self.device),
                          torch.ones(H, dtype=torch.int32), G, 1, d, 1,
                          q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=float(scaling))
        pages = (k.reshape(-1, 1, 1, d), v.reshape(-1, 1, 1, d))
        return self.wrapper.run(q.contiguous(), pages)
