"""Fidelity to the dense cache: teacher-forced next-token agreement and mean KL.

``full`` generates greedily from a prompt; the method under test then reads the same prompt and
is fed ``full``'s tokens one by one. At each step we compare its greedy choice with ``full``'s
(agreement) and its next-token distribution with ``full``'s (KL(full || method)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generation import Session


@dataclass
class Reference:
    prompt: list[int]
    tokens: list[int]  # full's greedy continuation
    logprobs: torch.Tensor  # (len(tokens), vocab) full's log-probabilities at each step


@dataclass
class Fidelity:
    agree: int
    total: int
    kl_sum: float

    @property
    def agreement(self) -> float:
        return self.agree / max(1, self.total)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(1, self.total)


def _forced(session: Session, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Log-probabilities before each of ``tokens`` (the first after the prompt's prefill). The
    run is planned for the prompt and ``tokens`` (positions, dense layers), as a generation of
    that many tokens would be."""
    out = []
    session.new_tokens = len(tokens)
    with torch.inference_mode():
        logits, _ = session.prefill(prompt)
        out.append(torch.log_softmax(logits.float(), -1))
        for t in tokens[:-1]:
            logits = session.forward([t])
            out.append(torch.log_softmax(logits.float(), -1))
    return out


def reference(loaded, settings, prompt: list[int], max_new_tokens: int,
              force_past_end: bool = False) -> Reference:
    """``full``'s greedy continuation; past the end of text too when ``force_past_end``.

    ``full`` keeps true positions: a run's ``positions: remap`` (for the methods it measures)
    does not apply to the reference. Its prompt is computed in the model's dtype (a
    ``prompt_compute`` in 16 bits is measured, not the measure)."""
    if settings.positions == "remap":
        settings = settings.replace(positions="true")
    settings = settings.replace(prompt_compute="model")
    session = Session(loaded, settings, "full")
    if force_past_end:
        stop, session.stop_ids = session.stop_ids, set()
    tokens, _ = session.generate(prompt, max_new_tokens)
    if force_past_end:
        session.stop_ids = stop
    if not tokens:
        return Reference(prompt, [], torch.empty(0))
    logprobs = torch.stack(_forced(Session(loaded, settings, "full"), prompt, tokens))
    return Reference(prompt, tokens, logprobs)


def measure(loaded, settings, method: str, ref: Reference) -> Fidelity:
    if not ref.tokens:
        return Fidelity(0, 0, 0.0)
    got = _forced(Session(loaded, settings, method), ref.prompt, ref.tokens)
    agree, kl = 0, 0.0
    for step, lp in enumerate(got):
        agree += int(int(lp.argmax()) == ref.tokens[step])
        p = ref.logprobs[step]
        kl += float((p.exp() * (p - lp)).sum())
    return Fidelity(agree, len(ref.tokens), kl)
