"""Settings for tests that exercise one mechanism on a tiny model: the library's defaults are the
shipped values (pinned answer passages, the rest estimate, the all-dense shortcut, ...), which
these tests leave off unless they are what the test is about."""

from __future__ import annotations

from typing import Any

from icecache.config import Settings

LAB = dict(weights="float", window_pages=2, dense_until=0, dense_kv="model", prompt_compute="model",
           answer_spans=0, max_context=131072, prefill="full", tail_budget=256, remap_pin_gap=0,
           index_beam_frac=0.001, index_pages="projection", carry_pages=0, rest_estimate=False,
           prefill_beam=0, index_walk_keys="float32")


def lab_settings(**changes: Any) -> Settings:
    """:class:`Settings` with the mechanisms above off, then ``changes``."""
    return Settings().replace(**(LAB | changes))
