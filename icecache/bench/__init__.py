"""Benchmarks behind ``icecache bench``: measured figures, ratios taken within one run."""

from ..cache.backend import TorchBackend

# The per-step breakdown of a benchmark is the device's time: on CUDA the stage timers
# synchronize (no effect on CPU).
TorchBackend.sync_timers = True
