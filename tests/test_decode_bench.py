"""The decode benchmark's bookkeeping on a short context (figures themselves are not asserted)."""

from __future__ import annotations

from icecache.bench import decode_bench


def test_decode_bench_shared_prefill(loaded, cpu_settings):
    settings = cpu_settings.replace(budget=64)
    shared = decode_bench.prefill(loaded, settings, 400)
    assert len(shared.ids) == 400
    full = decode_bench.run(loaded, settings, "full", 400, steps=2, shared=shared)
    ice = decode_bench.run(loaded, settings, "ice", 400, steps=2, shared=shared)
    assert full.ctx == ice.ctx == 400 and full.tpot_ms > 0 and ice.tpot_ms > 0
    # Resident KV of the sparse layers: sink 32 + window 32 + a page 16 + budget 64 = 144 tokens.
    per_token_layer = 2 * 3 * 64 * 4  # K and V, 3 KV heads, head_dim 64, float32
    assert ice.device_kv_bytes_sparse_layers == 28 * 144 * per_token_layer
    assert full.device_kv_bytes_sparse_layers == 28 * 404 * per_token_layer  # prompt + 2 warm-up + 2 timed
    assert ice.host_kv_bytes > 0 and full.host_kv_bytes == 0
    assert set(ice.breakdown_ms) == {"index_query", "page_loading", "ice_attention", "rest_of_model"}
