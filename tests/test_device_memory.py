"""A GPU profile's memory: the cap torch's allocator is held to, what the memory check counts
as available beside the weights, and which methods fit an 8B-shaped model's 32k and 128k runs
in 24 GiB (the figures of the GPU issue), all with torch.cuda's answers stood in for."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from icecache.config import load_profile
from icecache.memory import GIB, Need, available_bytes, cap_device, need_bytes, shortfall

PROFILE = load_profile("rtx4090-24gb")
LLAMA8B = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256)
WEIGHTS = 16_060_000_000  # the 8B shape's bf16 weights, bytes


@pytest.fixture
def card(monkeypatch):
    """An H200-sized card holding the 8B weights: what torch.cuda would say."""
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 140 * GIB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: seen.update(fraction=f, index=i))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: WEIGHTS)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: WEIGHTS + GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (120 * GIB, 140 * GIB))
    return seen


def test_the_cap_holds_torchs_allocator_to_the_profiles_card(card):
    assert cap_device(PROFILE) == pytest.approx(24 / 140)
    assert card == {"fraction": pytest.approx(24 / 140), "index": 0}
    assert cap_device(PROFILE.replace(device_memory_gib=0.0)) is None  # no cap named
    assert cap_device(load_profile("cpu")) is None


def test_the_weights_count_against_the_cap(card):
    have = available_bytes(PROFILE)
    assert have.device == 24 * GIB - WEIGHTS  # not the card's 120 GiB free
    assert available_bytes(PROFILE.replace(device_memory_gib=0.0)).device == 120 * GIB + GIB


def test_which_methods_fit_an_8b_model_in_24_gib(card):
    have = Need(device=available_bytes(PROFILE).device, host=96 * GIB)
    fits = {(m, ctx): shortfall(need_bytes(m, LLAMA8B, PROFILE, ctx + 11), have) is None
            for m in ("full", "ice", "offloaded") for ctx in (32768, 131072)}
    # full's 4.3 GB of KV at 32k fits beside 16 GB of weights, its 17 GB at 128k does not
    assert fits[("full", 32768)] and not fits[("full", 131072)]
    # ice keeps its budget on the device, the offloaded cache a few layers: both fit at 128k
    assert fits[("ice", 131072)] and fits[("offloaded", 131072)]
    off = need_bytes("offloaded", LLAMA8B, PROFILE, 131072)
    assert off.device < 2 * GIB and off.host == 16 * GIB  # 32 layers x 8 heads x 128 x 2 x 2 bytes a token


def test_the_index_estimate_counts_the_walks_int8_copy():
    """``index_walk_keys: int8`` keeps each key's int8 row beside its float one: the host estimate
    counts it per sparse layer, KV head and token; ``float32`` does not."""
    from icecache.memory import INDEX_INT8_BYTES_PER_KEY

    cpu = load_profile("cpu")
    tokens = 65536
    with_copy = need_bytes("ice", LLAMA8B, cpu.replace(index_walk_keys="int8"), tokens)
    without = need_bytes("ice", LLAMA8B, cpu.replace(index_walk_keys="float32"), tokens)
    sparse = LLAMA8B.num_hidden_layers - cpu.dense_layers
    assert with_copy.host - without.host == sparse * 8 * INDEX_INT8_BYTES_PER_KEY * tokens
    assert with_copy.device == without.device
