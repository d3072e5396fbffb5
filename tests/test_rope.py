"""RoPE scaling for runs past the trained context (icecache.rope): set per run, restored after."""

from __future__ import annotations

import pytest
import torch

from icecache import rope
from icecache.config import resolve_settings
from icecache.errors import ProfileError, UsageError
from icecache.methods import plan_run

from .test_ice_cache import tiny_model


def _cos(model, position: int) -> torch.Tensor:
    x = torch.zeros(1, 1, model.config.hidden_size)
    cos, _ = model.model.rotary_emb(x, torch.tensor([[position]]))
    return cos[0, 0]


@pytest.mark.parametrize("scaling", ["linear", "dynamic", "yarn"])
def test_scaling_set_for_long_runs_and_restored(scaling):
    model = tiny_model("llama", 2)
    trained = model.config.max_position_embeddings
    plain = _cos(model, 7).clone()
    original = dict(model.config.rope_parameters)
    rope.apply(model, scaling, trained // 2)  # inside the trained context: the model's own RoPE
    assert rope.current(model) == "default" and torch.equal(_cos(model, 7), plain)
    rope.apply(model, scaling, 4 * trained)
    assert rope.current(model) == scaling
    params = model.config.rope_parameters
    assert params["original_max_position_embeddings"] == trained
    assert params["factor"] == (2.0 if scaling == "dynamic" else 4.0)
    if scaling == "linear":  # position interpolation: position p looks like p / 4
        torch.testing.assert_close(_cos(model, 8), _cos_at(original, model, 2.0))
    if scaling != "dynamic":  # (dynamic changes nothing until a sequence outgrows the context)
        assert not torch.allclose(_cos(model, 7), plain)
    rope.apply(model, "none", 4 * trained)  # the next run asks for none: restored exactly
    assert model.config.rope_parameters == original and torch.equal(_cos(model, 7), plain)


def _cos_at(params: dict, model, position: float) -> torch.Tensor:
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else (
        model.config.hidden_size // model.config.num_attention_heads)
    inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    angles = position * inv
    return torch.cat([angles, angles]).cos()


def test_scaling_settings_and_plan():
    with pytest.raises(ProfileError, match="rope.scaling must be one of"):
        resolve_settings("cpu", rope_scaling="ntk")
    with pytest.raises(ProfileError, match="exclude each other"):
        resolve_settings("cpu", rope_scaling="yarn", positions="remap")
    model = tiny_model("llama", 2)
    trained = model.config.max_position_embeddings
    s = resolve_settings("cpu", rope_scaling="yarn")
    plan = plan_run("ice", model, s, 3 * trained, 10)  # a scaling keeps positions true
    assert plan.positions == "true" and rope.current(model) == "yarn"
    plan = plan_run("ice", model, resolve_settings("cpu"), 3 * trained, 10)
    assert plan.positions == "remap" and rope.current(model) == "default"
    other = tiny_model("llama", 2)  # RoPE settings per layer type: not rescaled, one clear error
    other.config.rope_parameters = {"full_attention": {"rope_theta": 1e4}}
    with pytest.raises(UsageError, match="not a single rope_parameters mapping"):
        plan_run("full", other, s, 3 * trained, 10)
    plan_run("full", other, resolve_settings("cpu"), 3 * trained, 10)  # none: nothing to do
