"""Which architectures load and which methods run them: a decoder with rotary attention in full
or sliding-window layers runs every method, a model that caps its attention scores (Gemma 2)
included (icecache's own attention applies the cap); anything else is refused at load in one
line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.errors import ModelError
from icecache.methods import make_cache
from icecache.models import check_architecture

from .lab import lab_settings
from .test_ice_cache import run_steps, tiny_model


def capped_gemma2(cap: float = 2.0, sharpen: float = 12.0):
    """The tiny Gemma 2 with a cap that bites: its queries and keys scaled up ``sharpen`` times
    (scores of a few units instead of a few hundredths) and its scores capped at ``cap``
    (the config's 50 would never be reached): the cap moves its logits by about 0.2."""
    model = tiny_model("gemma2")
    model.config.attn_logit_softcapping = cap
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = cap  # (each layer copies it at init)
            layer.self_attn.q_proj.weight.mul_(sharpen)
            layer.self_attn.k_proj.weight.mul_(sharpen)
    return model


# (method, settings changed, decode steps): budgets, sinks and windows that cover every token.
# SnapKV chooses among the prompt's tokens once: 3 steps, before a window page (of 16 tokens
# plus a page of slack) leaves for the host store; streaming has no budget: its window holds
# the whole run
CAPPED_RUNS = [("full", {}, 8), ("dense", {}, 8), ("oracle", {}, 8), ("oracle-qhead", {}, 8), ("ice", {}, 8),
               ("ice", {"rest_estimate": True, "answer_spans": 2}, 8), ("ice-reuse", {}, 8), ("quest", {}, 8),
               ("snapkv", {}, 3), ("streaming", {"window_pages": 20}, 8), ("h2o", {}, 8), ("arkvale", {}, 8),
               ("omnikv", {}, 8), ("pqcache", {}, 8), ("magicpig", {}, 8)]


@pytest.mark.parametrize("method,changes,steps", CAPPED_RUNS)
def test_a_capped_model_runs_every_method_as_one_capped_forward(method, changes, steps):
    """Gemma 2 caps its attention scores (``attn_logit_softcapping``): every method's own
    attention applies the cap (prefill, window layers, paged decode steps), so with room for every
    token each gives the logits of one forward of transformers' eager attention over the whole
    sequence; without the cap they would be about 0.2 off."""
    model = capped_gemma2()
    check_architecture(model)  # Gemma 2 loads
    rng = np.random.default_rng(5)
    prompt, forced = rng.integers(0, 97, 60).tolist(), rng.integers(0, 97, steps).tolist()
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        whole = model(input_ids=torch.tensor([prompt + forced])).logits[0][len(prompt) - 1 :]
    settings = lab_settings(**{"page_size": 4, "budget": 256, "sink_pages": 1, "window_pages": 4,
                               "chunk_size": 64, **changes})
    got = torch.stack(run_steps(model, make_cache(method, model, settings, 70), prompt, forced))
    if method == "full":
        assert model.config._attn_implementation == "eager"  # transformers' attention applies the cap
    else:
        assert model.config._attn_implementation.startswith("icecache")
    torch.testing.assert_close(got, whole, atol=2e-4, rtol=1e-4)


def test_an_architecture_without_rotary_attention_is_refused_in_one_line():
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2)).eval()
    with pytest.raises(ModelError, match="^architecture 'gpt2' is not supported: .*rotary") as info:
        check_architecture(gpt2)
    assert "\n" not in str(info.value)
    for arch in ("llama", "qwen3", "gemma3", "phi3"):
        check_architecture(tiny_model(arch))  # no error
