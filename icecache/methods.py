"""The KV-cache methods a run can use, and the cache object each one puts into the model.

``full`` keeps every key and value (transformers' dense cache). The IceCache method and the
baselines are registered here as they arrive; naming one that is not built yet is a clear error.
"""

from __future__ import annotations

from typing import Any

from .config import Settings
from .errors import MethodUnavailable

AVAILABLE = ("full",)
PLANNED = ("ice", "ice-reuse", "oracle", "streaming", "snapkv", "quest")


def check_method(method: str) -> str:
    if method in AVAILABLE:
        return method
    if method in PLANNED:
        raise MethodUnavailable(
            f"method '{method}' is not available yet in this version; use --method full"
        )
    raise MethodUnavailable(
        f"unknown method '{method}' (available: {', '.join(AVAILABLE)}; "
        f"planned: {', '.join(PLANNED)})"
    )


def make_cache(method: str, model: Any, settings: Settings) -> Any:
    """A fresh cache object for one sequence under ``method``."""
    check_method(method)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)
