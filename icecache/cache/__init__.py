"""KV-cache managers: the IceCache paged cache and its attention."""

from .attention import paged_decode_reference, register
from .backend import TorchBackend
from .dense import DenseCache, GrowingLayer
from .ice import IceCache, IceLayer, IceSpec, StepStats
from .oracle import OracleCache, OracleSpec

__all__ = ["DenseCache", "GrowingLayer", "IceCache", "IceLayer", "IceSpec", "OracleCache", "OracleSpec", "StepStats", "TorchBackend", "paged_decode_reference", "register"]
