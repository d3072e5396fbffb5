"""An ice cache's layers as a JSON skeleton plus named tensors, and back (no pickle).

The document cache (:mod:`icecache.doc_cache`) saves a sparse prefill's state this way: every
layer's host store, resident rows, window, page selector and index, exactly as held, so that a
later run continues as the saving run did. Only the package's own classes are rebuilt (by their
module and name, under ``icecache.``); the objects a fresh cache of the same settings already
has (its backend, statistics, spec, position remap, and the layers themselves, which ice-reuse
layers refer to) are referred to by name and taken from the cache being restored into.

Values: tensors (saved through their storage, so views stay views), NumPy arrays and scalars,
NumPy random generators, torch dtypes and devices, frozen dataclasses, lists, tuples, dicts,
and plain Python values.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

PACKAGE = "icecache."


class StateError(ValueError):
    pass


def _index_config(cache):
    """The DCI-trees' configuration, one object for every tree of the cache (saved by name)."""
    from .selectors.dci import spec_tree_config

    return spec_tree_config(cache.spec)


def _anchors(cache) -> dict[int, str]:
    named = {"backend": cache.backend, "stats": cache.stats, "spec": cache.spec, "remap": cache.remap,
             "index_config": _index_config(cache)}
    out = {id(v): k for k, v in named.items() if v is not None}
    for i, layer in enumerate(cache.layers):
        out[id(layer)] = f"layer.{i}"
    return out


def _resolve(cache, name: str) -> Any:
    if name.startswith("layer."):
        return cache.layers[int(name.split(".", 1)[1])]
    if name == "index_config":
        return _index_config(cache)
    return getattr(cache, name)


class _Packer:
    def __init__(self, cache):
        self.anchors = _anchors(cache)
        self.tensors: dict[str, torch.Tensor] = {}
        self.storages: dict[tuple, str] = {}
        self.memo: dict[int, int] = {}  # id(obj) -> object number (shared references)
        self.arrays: dict[int, dict] = {}  # id(array) -> its entry (an array held in two places)
        self.keep: list = []  # objects kept alive while packing (their ids stay unique)

    def storage(self, t: torch.Tensor) -> dict:
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes(), t.dtype)
        got = self.storages.get(key)
        if got is None:
            name = f"s{len(self.storages)}"
            flat = torch.empty(0, dtype=t.dtype, device=t.device)
            flat.set_(s, 0, (s.nbytes() // t.element_size(),), (1,))
            flat = flat.detach().to("cpu")
            rows, fill = _trailing(flat.numpy() if flat.dtype != torch.bfloat16 else flat.view(torch.int16).numpy())
            self.tensors[name] = flat[:rows]  # a view: see save_layers
            got = self.storages[key] = {"tensor": name, "rows": len(flat), "fill": fill}
        return got

    def pack(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v if not isinstance(v, float) or np.isfinite(v) else {"float": repr(v)}
        ref = self.anchors.get(id(v))
        if ref is not None:
            return {"anchor": ref}
        if isinstance(v, torch.Tensor):
            return {**self.storage(v), "offset": v.storage_offset(), "shape": list(v.shape),
                    "stride": list(v.stride()), "device": str(v.device), "dtype": str(v.dtype)}
        if isinstance(v, np.ndarray):
            got = self.arrays.get(id(v))
            if got is not None:
                return got
            name = f"a{len(self.tensors)}"
            a = np.ascontiguousarray(v)
            a = a.astype(np.uint8) if a.dtype == np.bool_ else a
            rows, fill = _trailing(a) if a.ndim else (0, None)
            if not a.ndim:
                saved = a.reshape(1).copy()
            elif a.base is None:  # an array owning its memory: a view of its used rows (see save_layers)
                saved = a[:rows]
            else:  # a view of another buffer is copied: two such views may overlap
                saved = a[:rows].copy()
            self.tensors[name] = torch.from_numpy(saved)
            got = self.arrays[id(v)] = {"array": name, "dtype": v.dtype.str, "shape": list(v.shape), "fill": fill}
            self.keep.append(v)
            return got
        if isinstance(v, np.generic):
            return {"np": v.dtype.str, "value": self.pack(v.item())}
        if isinstance(v, np.random.Generator):
            return {"rng": v.bit_generator.state}
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, (list, tuple)):
            return {"list" if isinstance(v, list) else "tuple": [self.pack(x) for x in v]}
        if isinstance(v, dict):
            return {"dict": [[self.pack(k), self.pack(x)] for k, x in v.items()]}
        cls = type(v)
        if not cls.__module__.startswith(PACKAGE):
            raise StateError(f"cannot save a {cls.__module__}.{cls.__name__}")
        if dataclasses.is_dataclass(v) and cls.__dataclass_params__.frozen:
            return {"frozen": f"{cls.__module__}:{cls.__qualname__}",
                    "fields": {f.name: self.pack(getattr(v, f.name)) for f in dataclasses.fields(v)}}
        n = self.memo.get(id(v))
        if n is not None:
            return {"ref": n}
        n = self.memo[id(v)] = len(self.memo)
        self.keep.append(v)
        # what the object's own __getstate__ keeps, as copy and pickle take it (a class leaves
        # out caches of views onto its buffers there: saved, they would be copies, not views);
        # Python 3.10's object has no __getstate__ of its own: its attributes then
        getstate = getattr(v, "__getstate__", None)
        attrs = (getstate() if getstate is not None else vars(v)) or {}
        return {"object": f"{cls.__module__}:{cls.__qualname__}", "id": n,
                "attrs": {k: self.pack(x) for k, x in attrs.items()}}


def _trailing(a: np.ndarray) -> tuple[int, Any]:
    """How many leading rows of ``a`` to keep and the value of every row after them (a list for
    rows of several values; None when nothing is cut): capacity-sized arrays are saved as far as
    they are used, the rest restored to what it held (their allocation's fill)."""
    n = a.shape[0]
    if n < 64:
        return n, None
    last = a[-1]
    flat = a.reshape(n, -1)
    same = (flat == flat[-1]).all(axis=1)
    if not same[-1]:
        return n, None
    differ = np.flatnonzero(~same)
    rows = int(differ[-1]) + 1 if len(differ) else 0
    if rows == n:
        return n, None
    return rows, last.tolist()


def _class(path: str):
    module, name = path.split(":")
    if not module.startswith(PACKAGE):
        raise StateError(f"refusing to build {path}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class _Unpacker:
    def __init__(self, cache, tensors: Mapping[str, torch.Tensor]):
        self.cache, self.tensors = cache, tensors
        self.objects: dict[int, Any] = {}
        self.storages: dict[tuple, torch.Tensor] = {}

    def unpack(self, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        if "anchor" in v:
            return _resolve(self.cache, v["anchor"])
        if "float" in v:
            return float(v["float"])
        if "tensor" in v:
            key = (v["tensor"], v["device"])
            flat = self.storages.get(key)
            if flat is None:
                saved = self.tensors[v["tensor"]]
                full = torch.empty(v["rows"], dtype=saved.dtype)
                full[: len(saved)] = saved
                if v["fill"] is not None and len(saved) < v["rows"]:
                    rest = full[len(saved):]
                    (rest.view(torch.int16) if rest.dtype == torch.bfloat16 else rest).fill_(v["fill"])
                flat = self.storages[key] = full.to(v["device"])
            return flat.as_strided(v["shape"], v["stride"], v["offset"])
        if "array" in v:
            dtype = np.dtype(v["dtype"])
            saved = self.tensors[v["array"]].numpy()
            shape = v["shape"]
            if not shape:
                a = saved.reshape(())
            else:
                a = np.empty(shape, saved.dtype)
                a[: len(saved)] = saved
                if len(saved) < shape[0]:
                    a[len(saved):] = np.asarray(v["fill"], saved.dtype)
            return a.astype(np.bool_) if dtype == np.bool_ else a.view(dtype).copy() if a.dtype != dtype else a
        if "np" in v:
            return np.dtype(v["np"]).type(self.unpack(v["value"]))
        if "rng" in v:
            g = np.random.Generator(getattr(np.random, v["rng"]["bit_generator"])())
            g.bit_generator.state = v["rng"]
            return g
        if "dtype" in v and len(v) == 1:
            return getattr(torch, v["dtype"])
        if "device" in v and len(v) == 1:
            return torch.device(v["device"])
        if "list" in v:
            return [self.unpack(x) for x in v["list"]]
        if "tuple" in v:
            return tuple(self.unpack(x) for x in v["tuple"])
        if "dict" in v:
            return {self.unpack(k): self.unpack(x) for k, x in v["dict"]}
        if "frozen" in v:
            return _class(v["frozen"])(**{k: self.unpack(x) for k, x in v["fields"].items()})
        if "ref" in v:
            return self.objects[v["ref"]]
        if "object" in v:
            cls = _class(v["object"])
            obj = cls.__new__(cls)
            self.objects[v["id"]] = obj
            for k, x in v["attrs"].items():
                object.__setattr__(obj, k, self.unpack(x))
            return obj
        raise StateError(f"unknown entry {sorted(v)}")


def save_layers(cache) -> tuple[dict, dict[str, torch.Tensor]]:
    """The state of every layer of ``cache`` (after its background work): a JSON-able skeleton
    and the tensors it names.

    The tensors are views onto the cache's own buffers where they can be (their used rows), not
    copies: a 100k-token document's state is several GB, and a copy held beside the cache while
    the file was written took the save's peak memory to the profile's 16 GiB. So write them (or
    copy them) before the cache changes again."""
    for layer in cache.ice_layers():
        layer.wait()
    p = _Packer(cache)
    layers = [{k: p.pack(x) for k, x in vars(layer).items()} for layer in cache.layers]
    return {"layers": layers, "stats": p.pack(dataclasses.asdict(cache.stats))}, p.tensors


def load_layers(cache, skeleton: dict, tensors: Mapping[str, torch.Tensor]) -> None:
    """Restore :func:`save_layers`' state into ``cache``, a fresh cache of the same settings."""
    if len(skeleton["layers"]) != len(cache.layers):
        raise StateError("the saved cache has another number of layers")
    u = _Unpacker(cache, tensors)
    for layer, attrs in zip(cache.layers, skeleton["layers"], strict=True):
        for k, x in attrs.items():
            object.__setattr__(layer, k, u.unpack(x))
    for k, x in u.unpack(skeleton["stats"]).items():
        setattr(cache.stats, k, x)
