"""KV-cache managers: the IceCache paged cache, the dense caches, the oracle, their attention.

How a decode step of an ice layer runs: ``attention.ice_attention`` (the function transformers
calls) -> ``IceLayer.attend`` (ice_layer.py) = ``select`` (the layer's page selector,
``selectors/``) -> ``load`` (``ResidentKV.load``, resident.py, through the backend) -> attention
over the resident rows (paged.py). See docs/ice.md.
"""

from .backend import TorchBackend
from .dense import DenseCache, GrowingLayer
from .ice import IceCache
from .ice_layer import IceLayer
from .oracle import OracleCache, OracleSpec
from .paged import paged_decode_reference, paged_decode_sdpa
from .spec import IceSpec, StepStats

__all__ = ["DenseCache", "GrowingLayer", "IceCache", "IceLayer", "IceSpec", "OracleCache", "OracleSpec",
           "StepStats", "TorchBackend", "paged_decode_reference", "paged_decode_sdpa"]
