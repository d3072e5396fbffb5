"""icecache: long documents through local LLMs with a clustered, offloaded, query-aware KV cache.

The public API::

    from icecache import resolve_settings, load_model, Runner
    settings = resolve_settings("cpu")
    runner = Runner(load_model(None, settings), settings, method="full")
    print(runner.summarize(open("report.txt").read()).output)
"""

from .config import Settings, resolve_settings
from .errors import IceCacheError
from .models import load_model

__version__ = "0.1.0"
__all__ = ["Settings", "resolve_settings", "load_model", "Runner", "TaskResult", "IceCacheError"]


def __getattr__(name: str):
    """``Runner`` and ``TaskResult`` import torch and transformers: on first use, so that the
    command line's ``--help``, ``--version`` and input errors answer without them."""
    if name in ("Runner", "TaskResult"):
        from . import tasks

        return getattr(tasks, name)
    raise AttributeError(f"module 'icecache' has no attribute {name!r}")
