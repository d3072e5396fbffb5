"""Which architectures load and which methods run them: a decoder with rotary attention in full
or sliding-window layers runs every method; a model that caps its attention scores (Gemma 2)
runs with transformers' own attention only; anything else is refused at load in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.errors import MethodUnavailable, ModelError
from icecache.methods import make_cache
from icecache.models import check_architecture

from .lab import lab_settings
from .test_ice_cache import run_steps, tiny_model


def test_a_capped_model_runs_full_through_transformers_and_refuses_the_others():
    model = tiny_model("gemma2")
    check_architecture(model)  # Gemma 2 loads
    rng = np.random.default_rng(5)
    prompt, forced = rng.integers(0, 97, 60).tolist(), rng.integers(0, 97, 5).tolist()
    settings = lab_settings(page_size=4, budget=16, sink_pages=1, window_pages=2, chunk_size=64)
    got = run_steps(model, make_cache("full", model, settings, 70), prompt, forced)
    assert model.config._attn_implementation == "eager"  # transformers' attention applies the cap
    with torch.inference_mode():  # the same as one forward over the whole sequence
        whole = model(input_ids=torch.tensor([prompt + forced])).logits[0]
    torch.testing.assert_close(torch.stack(got), whole[len(prompt) - 1 :], atol=1e-4, rtol=1e-4)
    for method in ("dense", "ice", "snapkv"):
        with pytest.raises(MethodUnavailable, match="attn_logit_softcapping 50.0.*--method full"):
            make_cache(method, model, settings, 70)


def test_an_architecture_without_rotary_attention_is_refused_in_one_line():
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2)).eval()
    with pytest.raises(ModelError, match="^architecture 'gpt2' is not supported: .*rotary") as info:
        check_architecture(gpt2)
    assert "\n" not in str(info.value)
    for arch in ("llama", "qwen3", "gemma3", "phi3"):
        check_architecture(tiny_model(arch))  # no error
