"""One-token decode steps of Llama-family models without transformers' forward (every decode
step of a session takes it where it applies, :func:`fast_step_for`).

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

Int4 weights (``weights: int4``, :class:`~icecache.weights.Int4Linear`): a layer's q/k/v products
run as one call of torch's int4 kernel over their packed weights side by side, and gate/up as
another, the input rounded to bfloat16 once for each (:class:`Int4Layer`). The kernel computes
every output channel on its own, so the joined products equal the separate ones bit for bit; the
modules keep views of the joined weights, so nothing is stored twice. A prompt step
(:func:`~icecache.weights.in_prompt`: the float model's products) or a layer whose modules were
replaced since takes the modules' own calls.

Gemma 2 and Gemma 3 differ from the Llama family in ways the step follows op for op: their RMS
norms scale by ``1 + weight``; a norm after the attention's output and one before and after the
MLP ("sandwich" norms); a GELU MLP (the module's own activation); per-head q/k norms (Gemma 3,
and Qwen 3); a RoPE per layer kind (Gemma 3: one base for its window layers, another for its
global ones); capped attention scores (Gemma 2, passed to the attention function as the model
passes them) and capped logits.

Window layers (Gemma's, Mistral's or Qwen 2's sliding window): a decode step's query sees every
key its cache layer returns, since the caches keep such a layer's window and nothing older
(:mod:`~icecache.cache.window`), so no mask is made for them either.

Which models: Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 decoder layers, RoPE over the
whole head, on the CPU in float32. Anything else runs transformers' forward, which stays the
reference the fast step is tested against (tests/test_fast_step.py: the logits of every method's
decode steps).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .fused_step import FusedLayers, paused, run_layers, run_split, whole_layers
from .weights import COMPUTE, GROUP, Int4Linear, in_prompt

# attention implementations whose decode over a plain dense growing layer is dense_decode
# (cache.attention: "icecache" is ice_attention, "icecache_dense" dense_attention)
FUSED_ATTENTION = ("icecache", "icecache_dense")

SUPPORTED = {  # model_type -> the decoder layer class transformers uses for it
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "gemma3_text": "Gemma3DecoderLayer",
}
GEMMA = ("gemma2", "gemma3_text")  # norms by 1 + weight, sandwich norms around attention and MLP


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama family's RMS norm of a float32 row, op for op as transformers computes it."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _llama_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    return _rms_norm(x, norm.weight, norm.variance_epsilon)


def _gemma_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """Gemma's RMS norm of a float32 row (scaled by ``1 + weight``), op for op as transformers'."""
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)) * (1.0 + norm.weight.float())


def _inv_freqs(rotary: Any) -> list[torch.Tensor]:
    """The rotary module's inverse frequencies (one per layer kind in Gemma 3)."""
    return [buf for name, buf in rotary.named_buffers() if name.endswith("inv_freq") and "original" not in name]


def _takes_layer_type(rotary: Any) -> bool:
    """Whether the rotary module's forward takes a layer kind (Gemma 3's: a RoPE base per kind)."""
    import inspect

    return "layer_type" in inspect.signature(rotary.forward).parameters


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
    if any(t not in ("full_attention", "sliding_attention") for t in (getattr(config, "layer_types", None) or [])):
        return "a layer with neither full nor sliding-window attention"
    try:
        param = next(model.parameters())
    except StopIteration:
        return "no parameters"
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"{param.dtype} on {param.device.type} (the fast step is float32 on the CPU)"
    attn = layers[0].self_attn
    freqs = _inv_freqs(inner.rotary_emb)
    if not freqs or any(2 * f.shape[-1] != attn.head_dim for f in freqs):
        return "RoPE over part of the head"
    return None


# The int4 kernel's weights join along their output rows only in whole blocks of its packing.
JOIN_ROWS = 64


class Int4Layer:
    """One decoder layer's int4 products joined (see the module docstring): ``qkv`` and ``gate_up``
    as (packed weights, table, bias or None), ``o`` and ``down`` likewise, each the kernel's
    arguments for a one-row product, and the modules they came from (to notice a swap). Made by
    :meth:`join`, which checks that the layout allows it."""

    def __init__(self, modules: tuple, qkv: tuple, gate_up: tuple, inter: int):
        self.modules, self.inter = modules, inter
        self.qkv, self.gate_up = qkv, gate_up
        self.o = (modules[3].kernel_weight, modules[3].kernel_table, modules[3].bias)
        self.down = (modules[6].kernel_weight, modules[6].kernel_table, modules[6].bias)

    @staticmethod
    def join(layer: Any) -> Int4Layer | None:
        """``layer``'s joined products, or None where the kernel's packing does not allow
        joining: it packs rows in blocks (of 64 on this CPU build), so a part whose rows are not
        whole blocks shifts the next part's; the joined products are checked against the
        modules' own on one row before they are used. Each module's ``kernel_weight`` then
        becomes a view of the joined one."""
        a, mlp = layer.self_attn, layer.mlp
        modules = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        parts = (modules[:3], modules[4:6])
        if any(m.out_features % JOIN_ROWS for group in parts for m in group):
            return None
        joined = [Int4Layer._joined(group) for group in parts]
        g = torch.Generator().manual_seed(0)
        for group, whole in zip(parts, joined, strict=True):
            x = torch.randn(1, group[0].in_features, generator=g).to(COMPUTE)
            # each module's own one-row product (not its forward: inside prompt_products, where
            # the step may first be made, that is the float product)
            own = [Int4Layer.product_of(x, (m.kernel_weight, m.kernel_table, m.bias)) for m in group]
            if not torch.equal(Int4Layer.product_of(x, whole), torch.cat(own, -1)):
                return None
        for group, (weight, _table, _bias) in zip(parts, joined, strict=True):
            at = 0
            for m in group:
                n = m.kernel_weight.shape[0]
                m.kernel_weight = weight[at : at + n]
                at += n
        return Int4Layer(modules, joined[0], joined[1], mlp.gate_proj.out_features)

    @staticmethod
    def _joined(mods: tuple) -> tuple:
        """(packed weights, table, bias or None) of ``mods``' products side by side."""
        weight = torch.cat([m.kernel_weight for m in mods], 0)
        table = torch.cat([m.kernel_table for m in mods], 1).contiguous()
        biases = [m.bias for m in mods]
        bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(m.out_features, dtype=m.act_dtype) if b is None else b for m, b in zip(mods, biases, strict=True)])
        return weight, table, bias

    def current(self, layer: Any) -> bool:
        """Whether ``layer`` still has the modules this was made from."""
        a, mlp = layer.self_attn, layer.mlp
        return self.modules == (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    @staticmethod
    def product_of(x: torch.Tensor, joined: tuple) -> torch.Tensor:
        """``x`` (1, in) already in bfloat16 -> (1, out) float32, as the modules compute a decode
        step's row (:class:`~icecache.weights.Int4Linear`)."""
        weight, table, bias = joined
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, GROUP, table).float()
        return y if bias is None else y + bias


def int4_layers(model: Any) -> list[Int4Layer | None] | None:
    """Each decoder layer's :class:`Int4Layer` (None for a layer whose products cannot be joined),
    where every layer's seven linear layers are a float32 model's
    :class:`~icecache.weights.Int4Linear` and it has no per-head norms; else None."""
    layers = model.model.layers
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if (hasattr(a, "q_norm") or not all(type(m) is Int4Linear for m in mods)
                or any(m.act_dtype != torch.float32 for m in mods)):
            return None
    return [Int4Layer.join(layer) for layer in layers]


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
        config = model.config
        attn = inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        gemma = config.model_type in GEMMA
        self.norm = _gemma_norm if gemma else _llama_norm
        self.sandwich = gemma  # a norm after the attention's output, and before and after the MLP
        self.silu = not gemma and getattr(config, "hidden_act", "silu") == "silu"  # else the MLP's act_fn
        self.final_cap = getattr(config, "final_logit_softcapping", None)
        # each layer's RoPE kind (Gemma 3: its layer type), or None: one RoPE for every layer
        self.rope_kinds = list(config.layer_types) if _takes_layer_type(inner.rotary_emb) else None
        # the attention function's keywords beyond the common ones, as each model's attention passes them
        self.attend_kwargs = []
        for layer in inner.layers:
            a, kw = layer.self_attn, {}
            if hasattr(a, "sliding_window") or config.model_type == "mistral":
                kw["sliding_window"] = getattr(a, "sliding_window", getattr(config, "sliding_window", None))
            if config.model_type == "gemma2":
                kw["softcap"] = a.attn_logit_softcapping
            self.attend_kwargs.append(kw)
        import sys

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # looked up each step (a method sets the model's attention implementation), imported once;
        # "eager" is the model's own module's function (Gemma 2's caps its scores)
        eager = sys.modules[type(attn).__module__].eager_attention_forward
        self._functions, self._eager = ALL_ATTENTION_FUNCTIONS, eager
        self.int4 = int4_layers(model)  # None: the modules' own products
        # the layers in numba where their weights allow (fused_step): made at the first such step
        self._fused: Any = None
        # each layer's attention scale and cap on its scores (0: none), as the whole fused layers take them
        self.scales = np.array([layer.self_attn.scaling for layer in inner.layers[: config.num_hidden_layers]],
                               np.float32)
        self.caps = np.array([kw.get("softcap") or 0.0 for kw in self.attend_kwargs[: config.num_hidden_layers]],
                             np.float32)

    def _fused_layers(self, cache: Any) -> FusedLayers | None:
        """The model's layers for :mod:`~icecache.fused_step` (made at the first such step), or
        None where this step takes the torch ops."""
        if self._fused is False or cache is None or in_prompt() or paused():
            return None
        if self._fused is None or not self._fused.current(self.model):
            self._fused = FusedLayers.of(self.model, getattr(self.model, "_icecache_int16_inputs", False)) or False
            if self._fused is False:
                return None
        return self._fused

    def _angles(self, x: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) for this step from the model's own rotary module (its angles and
        scaling), made once per RoPE kind."""
        rotary, n = self.inner.rotary_emb, self.model.config.num_hidden_layers
        if self.rope_kinds is None:
            cos, sin = rotary(x, position_ids=position_ids)
            return [(cos[:, None], sin[:, None])] * n
        made = {}
        for kind in set(self.rope_kinds[:n]):
            cos, sin = rotary(x, position_ids, kind)
            made[kind] = (cos[:, None], sin[:, None])
        return [made[kind] for kind in self.rope_kinds[:n]]

    def step(self, token: int, cache: Any) -> torch.Tensor:
        inner, H, Hk, d = self.inner, self.heads, self.kv_heads, self.head_dim
        norm = self.norm
        config = self.model.config
        attend = self._functions.get_interface(config._attn_implementation, self._eager)
        position = cache.get_seq_length() if cache is not None else 0
        ids = torch.tensor([[token]], dtype=torch.long)
        x = inner.embed_tokens(ids)  # (1, 1, D)
        position_ids = torch.tensor([[position]], dtype=torch.long)
        angles = self._angles(x, position_ids)
        fused = self._fused_layers(cache)
        if fused is not None:
            whole = whole_layers(cache, config.num_hidden_layers) if config._attn_implementation in FUSED_ATTENTION else None
            if whole is not None and all(layer is not None for layer in whole):
                # every layer whole, its attention over the cache's rows included
                x = run_layers(fused, whole, x.reshape(-1), angles, H, Hk, d, self.scales, self.caps).view(1, 1, -1)
            else:  # the cache's own update and attention between each layer's two fused parts (runs of whole layers whole)
                def attention(i, q, k, v):
                    k, v = cache.update(k, v, i)
                    a = inner.layers[i].self_attn
                    out, _ = attend(a, q, k, v, None, dropout=0.0, scaling=a.scaling, position_ids=position_ids,
                                    use_cache=True, **self.attend_kwargs[i])
                    return out

                x = run_split(fused, attention, x.reshape(-1), angles, H, Hk, d, whole, self.scales,
                              self.caps).view(1, 1, -1)
        half = d // 2
        joined = self.int4 if self.int4 is not None and not in_prompt() else None
        for i, layer in enumerate(inner.layers[: config.num_hidden_layers] if fused is None else []):
            a = layer.self_attn
            j = joined[i] if joined is not None else None
            if j is not None and not j.current(layer):
                j = None
            h = norm(x, layer.input_layernorm)
            if j is not None:  # (no per-head norms: int4_layers)
                qkv = j.product_of(h.view(1, -1).to(COMPUTE), j.qkv)
                # q and k side by side: RoPE on both at once without joining them
                qk = qkv[:, : (H + Hk) * d].view(1, 1, H + Hk, d).transpose(1, 2)
                v = qkv[:, (H + Hk) * d :].view(1, 1, Hk, d).transpose(1, 2)
            else:
                q = a.q_proj(h).view(1, 1, H, d)
                k = a.k_proj(h).view(1, 1, Hk, d)
                v = a.v_proj(h).view(1, 1, Hk, d).transpose(1, 2)
                if hasattr(a, "q_norm"):  # Qwen3, Gemma 3: per-head norms before RoPE
                    q = norm(q, a.q_norm)
                    k = norm(k, a.k_norm)
                qk = torch.cat([q, k], dim=2).transpose(1, 2)
            # RoPE on q and k at once, op for op as transformers applies it
            cos, sin = angles[i]
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
            q, k = qk[:, :H], qk[:, H:]
            if cache is not None:
                k, v = cache.update(k, v, i)
            out, _ = attend(a, q, k, v, None, dropout=0.0, scaling=a.scaling, position_ids=position_ids,
                            use_cache=True, **self.attend_kwargs[i])
            if j is not None:
                o = j.product_of(out.reshape(1, H * d).to(COMPUTE), j.o).view(1, 1, -1)
            else:
                o = a.o_proj(out.reshape(1, 1, H * d))
            if self.sandwich:
                x = x + norm(o, layer.post_attention_layernorm)
                h = norm(x, layer.pre_feedforward_layernorm)
            else:
                x = x + o
                h = norm(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            if j is not None:
                gu = j.product_of(h.view(1, -1).to(COMPUTE), j.gate_up)
                gate, up = gu[:, : j.inter], gu[:, j.inter :]
            else:
                gate, up = mlp.gate_proj(h), mlp.up_proj(h)
            act = (F.silu(gate) if self.silu else mlp.act_fn(gate)) * up
            m = j.product_of(act.to(COMPUTE), j.down).view(1, 1, -1) if j is not None else mlp.down_proj(act)
            x = x + (norm(m, layer.post_feedforward_layernorm) if self.sandwich else m)
        x = norm(x, inner.norm)
        logits = self.model.lm_head(x)[0, -1]
        if self.final_cap is not None:  # Gemma 2: the logits capped, as its forward caps them
            logits = torch.tanh(logits / self.final_cap) * self.final_cap
        return logits


def fast_step_for(model: Any) -> FastStep | None:
    """The model's :class:`FastStep` (made once and kept on the model), or None where it cannot
    run that model."""
    got = getattr(model, "_icecache_fast_step", False)
    if got is False:
        got = FastStep(model) if why_not(model) is None else None
        model._icecache_fast_step = got
    return got
