"""Real keys and queries from a model, for measuring the index.

``capture`` runs the model over a long generated text and keeps the post-RoPE keys of chosen
layers, plus the queries of the last ``num_queries`` tokens, which play the decode steps: they
come after every captured key.

Up to ``exact_max`` tokens (the model's trained context) this is the real prefill, chunk after
chunk over a growing cache, so keys and queries are exactly those of a one-shot run. Beyond it,
a one-shot prefill is too slow on a CPU, so chunks are run independently at their true absolute
positions (real content, real RoPE rotations), each preceded by the text's first ``sink`` tokens
at positions 0.. (so that the attention sink is the real one, not each chunk's first token);
the sink prefix's own keys are kept once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..cache.chunked import sdpa_forward
from ..textgen import generated_text


@dataclass
class Capture:
    """keys[layer]: (num_kv_heads, n, head_dim); queries[layer]: (num_heads, num_queries, head_dim)."""

    layers: list[int]
    keys: dict[int, np.ndarray]
    queries: dict[int, np.ndarray]
    num_kv_heads: int
    num_heads: int
    head_dim: int


def capture(loaded, num_keys: int, layers: list[int], num_queries: int = 8, chunk: int = 2048,
            seed: int = 0, on_chunk=None, exact_max: int | None = None, sink: int = 4) -> Capture:
    """Keys of the first ``num_keys`` tokens and queries of the next ``num_queries``."""
    from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
    from transformers.masking_utils import sdpa_mask

    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config
    total = num_keys + num_queries
    ids: list[int] = []
    words = total
    while len(ids) < total:
        ids = tok(generated_text(words, seed))["input_ids"]
        words = int(words * 1.3) + 16
    ids = ids[:total]
    recorded: dict[int, torch.Tensor] = {}

    def recording(module, query, key, value, attention_mask, **kw):
        if module.layer_idx in layers:
            recorded[module.layer_idx] = query[0].detach().float()
        return sdpa_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("icecache_capture", recording)
    # The same masks as sdpa (without a registered mask function, transformers passes none, and
    # a chunk after the first would attend causally from the top-left corner).
    AttentionMaskInterface.register("icecache_capture", sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("icecache_capture")
    keys = {layer: [] for layer in layers}
    queries = {}

    if exact_max is None:
        exact_max = int(getattr(cfg, "max_position_embeddings", 8192) or 8192)
    exact = total <= exact_max

    def run(lo: int, hi: int, cache=None, prefix: int = 0):
        """Tokens lo..hi (after the first ``prefix`` tokens when given); the cache after it."""
        cache = cache if cache is not None else DynamicCache(config=cfg)
        span = list(range(prefix)) + list(range(lo, hi))
        model(input_ids=torch.tensor([[ids[i] for i in span]]), position_ids=torch.tensor([span]),
              past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache

    try:
        with torch.inference_mode():
            if exact:
                cache = DynamicCache(config=cfg)
                for lo in range(0, total, chunk):
                    hi = min(lo + chunk, total)
                    recorded.clear()
                    run(lo, hi, cache)
                    if on_chunk:
                        on_chunk(hi, total)
                for layer in layers:
                    keys[layer].append(cache.layers[layer].keys[0, :, :num_keys].float().numpy())
                    last = recorded[layer]  # queries of the final chunk
                    queries[layer] = last[:, -num_queries:].numpy()
            else:
                for lo in range(0, num_keys, chunk):
                    hi = min(lo + chunk, num_keys)
                    pre = 0 if lo == 0 else min(sink, num_keys)
                    cache = run(lo, hi, prefix=pre)
                    for layer in layers:
                        # (kv_heads, len, dim), after RoPE; the sink prefix's keys only once
                        keys[layer].append(cache.layers[layer].keys[0, :, pre:].float().numpy())
                    if on_chunk:
                        on_chunk(hi, total)
                # The decode-step queries: the last tokens, after the sink and a chunk of context.
                recorded.clear()
                run(max(sink, total - chunk), total, prefix=sink)
                for layer in layers:
                    queries[layer] = recorded[layer][:, -num_queries:].numpy()
    finally:
        model.set_attn_implementation(previous)
    return Capture(
        layers=list(layers),
        keys={layer: np.ascontiguousarray(np.concatenate(keys[layer], 1)) for layer in layers},
        queries=queries,
        num_kv_heads=cfg.num_key_value_heads,
        num_heads=cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
    )
