"""The selector contract (:class:`PageSelector`), the registry, and :class:`HeadIndexes`, the base
of the selectors that keep an index per KV head."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..spec import IceSpec

SELECTORS: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a selector that has none."""


def register(name: str):
    """Class decorator: make a selector known under ``name``."""

    def add(cls):
        SELECTORS[name] = cls
        cls.name = name
        return cls

    return add


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}  # a settings field's annotation


def tunable() -> dict[str, tuple[type, Any]]:
    """Every selector's settings as profile keys: key -> (type, default). A key two selectors
    share means the same thing to both and has one default (checked here)."""
    out: dict[str, tuple[type, Any]] = {}
    for cls in SELECTORS.values():
        for f in dataclasses.fields(cls.Settings):
            got = (_TYPES[str(f.type)], f.default)
            if out.setdefault(f.name, got) != got:
                raise TypeError(f"selector key {f.name} has two types or defaults")
    return out


def settings_for(name: str, values: Mapping[str, Any]) -> Any:
    """Selector ``name``'s settings dataclass from profile keys (``values``; the keys of other
    selectors are ignored). A value it refuses raises ValueError."""
    cls = SELECTORS[name].Settings
    own = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in own})


class PageSelector:
    """One ice layer's page choice: every member an ice layer reads, with the default a selector
    that does not need it inherits (so the layer asks the selector, never probes it). Point ids
    are host-store rows (the offloaded tokens in order).

    ``Settings``: the selector's own frozen dataclass (its keys reach it from a profile, a flag
    or a method variant such as ``ice[carry_pages=8]``; its defaults are the shipped values);
    ``IceSpec.tuning`` holds an instance, or None for the defaults."""

    name = ""
    Settings: type = NoSettings
    indexed = True  # False: selects nothing, keeps no index (the pool has no slots)
    waits_for_queries = False  # needs the prompt's last queries before the prompt is offloaded
    budget_in_index = False  # its index holds a choice made for one budget (no IceCache.forked)
    estimates = False  # the attention weighs the chosen rows by :meth:`row_bias` (MagicPIG)
    has_tree = False  # :meth:`tree_pages` answers now (dci with its trees built: rest_estimate)
    whole_tree_pages = True  # where has_tree: the pool's main slots hold whole tree pages

    def __init__(self, spec: IceSpec):
        self.spec = spec
        tuning = self.Settings() if spec.tuning is None else spec.tuning
        if not isinstance(tuning, self.Settings):
            raise TypeError(f"selector {self.name} takes {self.Settings.__name__}, not {type(tuning).__name__}")
        self.settings = tuning

    @property
    def rest_estimate(self) -> bool:
        """Whether the pages a step does not load attend as one estimate row each
        (:mod:`..rest`; needs :meth:`tree_pages`)."""
        return False

    def observe(self, queries: torch.Tensor, positions: np.ndarray | None = None) -> None:
        """The prompt's queries at a prefill chunk (query heads, chunk, head_dim), at prompt
        ``positions`` (None: the chunk after the last one observed)."""

    def build(self, prompt_keys: torch.Tensor, lo: int, hi: int, capacity: int,
              middle: torch.Tensor | None = None) -> None:
        """Index the offloaded prompt tokens ``lo .. hi-1`` of ``prompt_keys`` (heads, T, d)
        as points ``0 .. hi-lo-1``, one index per KV head; ``capacity``: the points expected
        in all; ``middle``: those tokens' keys as the host store holds them (un-rotated when
        positions are remapped), if not ``prompt_keys[:, lo:hi]``."""
        raise NotImplementedError

    def insert(self, keys: torch.Tensor) -> None:
        """Index newly offloaded keys (heads, m, d) on the host, as the next point ids."""
        raise NotImplementedError

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        """queries (heads, group, d) float32 -> per KV head at most ``max_pages`` page ids.
        ``wide``: an approximate search covers at least this share of the indexed keys (1: an
        exact search); exact selectors ignore it."""
        raise NotImplementedError

    def select_prefill(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        """The choice for a sparse prefill (a chunk's few choosing positions, or one of the
        prompt's last steps): :meth:`select` unless a selector chooses differently there."""
        return self.select(queries, max_pages, wide)

    def page_table(self, head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Head ``head``'s pages: members (pages, page_size) point ids, count (pages,), and
        version (pages,): a page whose members changed has a higher version."""
        raise NotImplementedError

    def tree_pages(self, head: int) -> tuple:
        """Where :attr:`has_tree`: head ``head``'s index pages whatever the pool loads (members,
        count, versions, pages in use, the index page of each host row)."""
        raise NotImplementedError

    def row_bias(self, pool_rows: np.ndarray) -> np.ndarray:
        """Where :attr:`estimates`: the log-weight of each pool row (heads, rows) this step."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop the index (the host store stays)."""


class HeadIndexes(PageSelector):
    """One index per KV head (``new_index``), with the page versions the pool compares against.

    An index offers ``insert(keys) -> dirty pages``, ``members``/``count``/``npages`` and
    ``select_group(queries, k, max_pages) -> pages``.
    """

    def __init__(self, spec: IceSpec):
        super().__init__(spec)
        self.head_dim = 0
        self.indexes: list = []
        self.versions: list[np.ndarray] = []

    def new_index(self, head: int, capacity: int):
        """An empty index for KV head ``head`` (``self.head_dim`` is known by then)."""
        raise NotImplementedError

    def build(self, prompt_keys: torch.Tensor, lo: int, hi: int, capacity: int,
              middle: torch.Tensor | None = None) -> None:
        middle = prompt_keys[:, lo:hi] if middle is None else middle
        keys = middle.float().cpu().numpy()  # the keys before any host rounding
        self.head_dim = keys.shape[2]
        self.indexes, self.versions = [], []
        for h in range(keys.shape[0]):
            index = self.new_index(h, capacity)
            index.insert(keys[h])
            self.indexes.append(index)
            self.versions.append(np.zeros(max(64, index.npages * 2), np.int64))

    def insert(self, keys: torch.Tensor) -> None:
        keys_np = keys.float().numpy()
        for h, index in enumerate(self.indexes):
            dirty = index.insert(keys_np[h])
            ver = self.versions[h]
            if index.npages > len(ver):
                grown = np.zeros(2 * index.npages, np.int64)
                grown[: len(ver)] = ver
                self.versions[h] = ver = grown
            ver[dirty] += 1

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        k = max_pages * self.spec.page_size
        return [index.select_group(queries[h], k, max_pages) for h, index in enumerate(self.indexes)]

    def page_table(self, head: int):
        index = self.indexes[head]
        return index.members, index.count, self.versions[head]

    def release(self) -> None:
        self.indexes, self.versions = [], []
