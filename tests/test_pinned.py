"""Every method's greedy output and chosen pages on a tiny model, pinned.

``tests/data/pinned_methods.json`` was written by this file's ``__main__`` on the code before the
cache was restructured (issue 15); refactors must reproduce it exactly. Regenerate it only for a
change that is meant to alter outputs, and say so in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from icecache.config import Settings
from icecache.methods import make_cache

from .lab import lab_settings

PINNED = Path(__file__).parent / "data" / "pinned_methods.json"
NEW_TOKENS = 24
SETTINGS = lab_settings(page_size=4, budget=16, sink_pages=2, window_pages=2, dense_layers=1,
                    chunk_size=64, prefill_budget=16, prefill_queries=4, dense_window=32,
                    max_context=4096)
CASES = {  # case -> (method, settings changes)
    **{m: (m, {}) for m in ("full", "dense", "ice", "ice-reuse", "oracle", "oracle-qhead",
                            "streaming", "quest", "snapkv")},
    "ice-serial": ("ice", {"pipeline": False}),
    "ice-sparse": ("ice", {"prefill": "sparse"}),
    "ice-reuse-sparse": ("ice-reuse", {"prefill": "sparse", "reuse_every": 2}),
    "quest-sparse": ("quest", {"prefill": "sparse"}),
    "streaming-sparse": ("streaming", {"prefill": "sparse"}),
}
ADOPTED = ("full", "ice", "snapkv", "oracle")  # from one shared dense prefill (the eval's path)


def tiny_model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return tf.LlamaForCausalLM(cfg).eval()


def prompt() -> list[int]:
    return np.random.default_rng(5).integers(0, 97, 300).tolist()


def selected_pages(cache) -> list:
    """Per ice layer, per KV head, the pages selected at the last step ([] for dense caches)."""
    if not hasattr(cache, "ice_layers"):
        return []
    return [[[int(p) for p in head] for head in layer.selected] for layer in cache.ice_layers()]


@torch.inference_mode()
def run_case(model, method: str, settings: Settings) -> dict:
    ids = prompt()
    cache = make_cache(method, model, settings)
    if hasattr(cache, "begin_prefill"):
        cache.begin_prefill(len(ids))
    pages = []
    for lo in range(0, len(ids), settings.chunk_size):
        x = torch.tensor([ids[lo : lo + settings.chunk_size]])
        out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        if settings.prefill == "sparse":  # each chunk selects (a full prefill: nothing yet)
            pages.append(selected_pages(cache))
    if hasattr(cache, "end_prefill"):
        cache.end_prefill()
    tokens = []
    for _ in range(NEW_TOKENS):
        t = int(torch.argmax(out.logits[0, -1]))
        tokens.append(t)
        out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        pages.append(selected_pages(cache))
    return {"tokens": tokens, "pages": pages}


@torch.inference_mode()
def run_adopted(model, methods) -> dict:
    from icecache.generation import Session, prefill_once

    loaded = SimpleNamespace(model=model, tokenizer=SimpleNamespace(eos_token_id=None), end_ids=frozenset())
    pre = prefill_once(loaded, SETTINGS, prompt())
    out = {}
    for m in methods:
        tokens, _ = Session(loaded, SETTINGS, m).generate_from(pre, NEW_TOKENS)
        out[m] = tokens
    return out


def compute() -> dict:
    model = tiny_model()
    result = {case: run_case(model, m, SETTINGS.replace(**ch)) for case, (m, ch) in CASES.items()}
    result["adopted"] = run_adopted(model, ADOPTED)
    return result


@pytest.fixture(scope="module")
def computed():
    return compute()


@pytest.mark.parametrize("case", [*CASES, "adopted"])
def test_outputs_and_pages_pinned(computed, case):
    want = json.loads(PINNED.read_text())[case]
    assert computed[case] == want


def test_pinned_cases_differ():
    """The pins are not vacuous: the methods choose differently and decode differently."""
    want = json.loads(PINNED.read_text())
    assert want["ice"]["tokens"] != want["streaming"]["tokens"] or want["ice"]["pages"] != want["quest"]["pages"]
    assert any(step for step in want["ice"]["pages"][-NEW_TOKENS:])  # ice selected pages
    assert want["ice"]["pages"] != want["quest"]["pages"]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    PINNED.write_text(json.dumps(compute()))
    print(f"wrote {PINNED}")
