"""``answer_search``: the first N generated tokens search as the prompt's last steps do (at
least ``tail_beam_frac`` of the keys), the later ones with the decode beam; the same whether the
prompt came in announced chunks (a prefill) or whole (a shared prefill adopted by a method)."""

from __future__ import annotations

import pytest
import torch

from icecache.cache.selectors.dci import DCISelector
from icecache.config import ProfileError, resolve_settings
from icecache.methods import make_cache
from tests.test_pinned import SETTINGS, prompt, tiny_model

N_ANSWER, STEPS = 5, 12


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _decode_wides(model, settings, monkeypatch, announced: bool) -> list[list[float]]:
    """Per decode step, the ``wide`` of every ice layer's search (after a prefill of the pinned
    prompt in chunks, or given to the cache whole)."""
    calls: list[float] = []
    real = DCISelector.select

    def spy(self, queries, max_pages, wide=0.0):
        calls.append(wide)
        return real(self, queries, max_pages, wide)

    monkeypatch.setattr(DCISelector, "select", spy)
    ids = prompt()
    cache = make_cache("ice", model, settings)
    with torch.inference_mode():
        if announced:
            cache.begin_prefill(len(ids))
            for lo in range(0, len(ids), settings.chunk_size):
                out = model(input_ids=torch.tensor([ids[lo : lo + settings.chunk_size]]),
                            past_key_values=cache, use_cache=True)
            cache.end_prefill()
        else:
            out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        calls.clear()  # (a prefill's own searches)
        per_step = []
        t = int(out.logits[0, -1].argmax())
        for _ in range(STEPS):
            out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            t = int(out.logits[0, -1].argmax())
            per_step.append(list(calls))
            calls.clear()
    return per_step


@pytest.mark.parametrize("announced", [True, False])
def test_the_first_generated_tokens_search_every_key(model, monkeypatch, announced):
    settings = SETTINGS.replace(answer_search=N_ANSWER, tail_beam_frac=1.0)
    per_step = _decode_wides(model, settings, monkeypatch, announced)
    layers = len(per_step[0])
    assert layers == model.config.num_hidden_layers - settings.dense_layers
    assert all(len(step) == layers for step in per_step)
    assert per_step[:N_ANSWER] == [[1.0] * layers] * N_ANSWER
    assert per_step[N_ANSWER:] == [[0.0] * layers] * (STEPS - N_ANSWER)


def test_off_by_default(model, monkeypatch):
    per_step = _decode_wides(model, SETTINGS, monkeypatch, True)
    assert all(w == 0.0 for step in per_step for w in step)


def test_answer_search_setting_is_checked():
    assert resolve_settings("cpu", answer_search=8).answer_search == 8
    with pytest.raises(ProfileError, match="answer.search"):
        resolve_settings("cpu", answer_search=-1)
