"""The host store of one ice layer: every offloaded key and value, per KV head, in token order.

Keys and values are (heads, capacity, head_dim) host tensors (pinned on CUDA, allocated by the
backend), rows ``0 .. rows-1`` filled. Row ``r`` of head ``h`` is the ``r``-th offloaded token,
which is also the point id the head's index gives it; a page load reads rows by these ids from
the flattened store (:meth:`flat`, head ``h`` starting at row ``h * capacity``).
"""

from __future__ import annotations

import copy

import torch

from .backend import TorchBackend


class HostStore:
    def __init__(self, backend: TorchBackend, heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int):
        self.backend, self.heads, self.head_dim, self.dtype = backend, heads, head_dim, dtype
        self.rows = 0
        self.capacity = capacity
        self.keys = backend.host_empty((heads, capacity, head_dim), dtype)
        self.values = backend.host_empty((heads, capacity, head_dim), dtype)

    _shared = False  # keys/values shared with a copy: the next append copies them first

    def __deepcopy__(self, memo) -> HostStore:
        """A copy sharing the stored rows (a forked cache's store: filled rows never change,
        and each side's next :meth:`append` writes into its own copy)."""
        twin = copy.copy(self)
        memo[id(self)] = twin
        twin.backend = copy.deepcopy(self.backend, memo)
        self._shared = twin._shared = True
        return twin

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows (heads, m, head_dim) after the filled ones; a full store grows by a quarter
        (a long document leaves little slack) or by what the rows need. A store shared with a
        copy takes its own buffers first."""
        assert keys.shape == values.shape and keys.shape[0] == self.heads and keys.shape[2] == self.head_dim, \
            f"rows {tuple(keys.shape)} / {tuple(values.shape)} for a store of {self.heads} heads x {self.head_dim}"
        m = keys.shape[1]
        full = self.rows + m > self.capacity
        if full or self._shared:
            cap = self.rows + m + max(self.capacity // 4, 4 * m) if full else self.capacity
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = self.backend.host_empty((self.heads, cap, self.head_dim), self.dtype)
                new[:, : self.rows] = old[:, : self.rows]
                setattr(self, name, new)
            self.capacity = cap
            self._shared = False
        self.keys[:, self.rows : self.rows + m] = keys
        self.values[:, self.rows : self.rows + m] = values
        self.rows += m
        assert self.rows <= self.capacity == self.keys.shape[1] == self.values.shape[1]

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as (heads * capacity, head_dim) rows."""
        return self.keys.view(-1, self.head_dim), self.values.view(-1, self.head_dim)

    def nbytes(self) -> int:
        """Bytes of the filled rows (keys and values)."""
        return 2 * self.heads * self.rows * self.head_dim * self.keys.element_size()
