"""Benchmarks behind ``icecache bench``: measured figures, ratios taken within one run."""


def sync_timers() -> None:
    """The per-step breakdown of a benchmark is the device's time: on CUDA the stage timers
    synchronize from the first benchmark on (no effect on CPU). Called by each entry point rather
    than on import, so that the command line's option checks need no torch."""
    from ..cache.backend import TorchBackend

    TorchBackend.sync_timers = True
