"""One-token decode steps of Llama-family models without transformers' forward (``fast_step``).

On the CPU a decode step of the embedded model spends milliseconds in the machinery around its
ops: the causal-mask builder, the output-capturing wrappers, keyword plumbing through four levels
of modules and their calls. :class:`FastStep` runs the same step from the same modules and the
same cache: the embedding; per layer the input norm, the q/k/v projections (the modules
themselves, so quantized linears and hooks work as before), RoPE on q and k at once with the
cos and sin of the model's own rotary module (made once per step, so scaled RoPE variants keep
their angles), ``cache.update`` and the attention function transformers would call for the
model's attention implementation, the output projection, the post-attention norm and the MLP;
then the final norm and the LM head. Each op is the one transformers runs, in the same order, so
the logits are the forward's bit for bit (an int4 model's bfloat16 activations carry a last-bit
difference into its logits: torch's fused ``rms_norm`` or RoPE as a product with a rotation matrix
moved them by up to 0.1 there).

Which models: Llama, Mistral, Qwen2 and Qwen3 decoder layers, SiLU MLPs, full attention in every
layer (no sliding window), RoPE over the whole head, on the CPU in float32. Anything else runs
transformers' forward, which stays the reference the fast step is tested against
(tests/test_fast_step.py: the logits of every method's decode steps).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED = {  # model_type -> the decoder layer class transformers uses for it
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama family's RMS norm of a float32 row, op for op as transformers computes it."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def why_not(model: Any) -> str | None:
    """None if :class:`FastStep` can run ``model``'s decode steps, else the reason it cannot."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model type {kind!r}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model, "lm_head") or not hasattr(inner, "rotary_emb"):
        return "not a causal LM with decoder layers and a rotary embedding"
    if any(type(layer).__name__ != SUPPORTED[kind] for layer in layers):
        return "a decoder layer of another class"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "a layer without full attention"
    try:
        param = next(model.parameters())
    except StopIteration:
        return "no parameters"
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"{param.dtype} on {param.device.type} (the fast step is float32 on the CPU)"
    attn = layers[0].self_attn
    half = inner.rotary_emb.inv_freq.shape[-1]
    if 2 * half != attn.head_dim:
        return "RoPE over part of the head"
    return None


class FastStep:
    """Decode steps of one model: ``step(token, cache) -> logits (vocab,)``, the logits
    ``model(input_ids=[[token]], past_key_values=cache, use_cache=True, logits_to_keep=1)`` gives,
    the cache updated as that call updates it."""

    def __init__(self, model: Any):
        reason = why_not(model)
        if reason is not None:
            raise ValueError(f"no fast decode step for this model: {reason}")
        self.model = model
        inner = model.model
        self.inner = inner
        attn = inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        # looked up each step (a method sets the model's attention implementation), imported once
        self._functions, self._eager = ALL_ATTENTION_FUNCTIONS, eager_attention_forward

    def step(self, token: int, cache: Any) -> torch.Tensor:
        inner, H, Hk, d = self.inner, self.heads, self.kv_heads, self.head_dim
        config = self.model.config
        attend = self._functions.get_interface(config._attn_implementation, self._eager)
        position = cache.get_seq_length() if cache is not None else 0
        ids = torch.tensor([[token]], dtype=torch.long)
        x = inner.embed_tokens(ids)  # (1, 1, D)
        position_ids = torch.tensor([[position]], dtype=torch.long)
        cos, sin = inner.rotary_emb(x, position_ids=position_ids)  # the model's own angles and scaling
        cos, sin = cos[:, None], sin[:, None]
        half = d // 2
        for i, layer in enumerate(inner.layers[: config.num_hidden_layers]):  # as the forward does
            a = layer.self_attn
            norm = layer.input_layernorm
            h = _rms_norm(x, norm.weight, norm.variance_epsilon)
            q = a.q_proj(h).view(1, 1, H, d)
            k = a.k_proj(h).view(1, 1, Hk, d)
            v = a.v_proj(h).view(1, 1, Hk, d).transpose(1, 2)
            if hasattr(a, "q_norm"):  # Qwen3: per-head norms before RoPE
                q = a.q_norm(q)
                k = a.k_norm(k)
            # RoPE on q and k at once, op for op as transformers applies it
            qk = torch.cat([q, k], dim=2).transpose(1, 2)
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
            q, k = qk[:, :H], qk[:, H:]
            if cache is not None:
                k, v = cache.update(k, v, i)
            out, _ = attend(a, q, k, v, None, dropout=0.0, scaling=a.scaling, position_ids=position_ids,
                            use_cache=True)
            x = x + a.o_proj(out.reshape(1, 1, H * d))
            norm = layer.post_attention_layernorm
            h = _rms_norm(x, norm.weight, norm.variance_epsilon)
            mlp = layer.mlp
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        x = _rms_norm(x, inner.norm.weight, inner.norm.variance_epsilon)
        return self.model.lm_head(x)[0, -1]


def fast_step_for(model: Any) -> FastStep | None:
    """The model's :class:`FastStep` (made once and kept on the model), or None where it cannot
    run that model."""
    got = getattr(model, "_icecache_fast_step", False)
    if got is False:
        got = FastStep(model) if why_not(model) is None else None
        model._icecache_fast_step = got
    return got
