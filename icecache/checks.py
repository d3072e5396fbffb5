"""What a run checks before a model is loaded (the limits of prompt and generation, the
questions), and the tasks' generation defaults the command line shows: light to import, so that
a bad input or ``--help`` answers before torch and transformers load."""

from __future__ import annotations

from .config import Settings
from .errors import InputError
from .methods import get

# Greedy decoding of a small model loops in long free text; a mild penalty on already generated
# tokens keeps summaries from repeating themselves. Extractive tasks (qa, cot) default to none.
SUMMARY_REPETITION_PENALTY = 1.15


def context_limit(settings: Settings, trained: int | None, method: str = "full") -> int:
    """Prompt + generation tokens a run may hold: the profile's ``max_context`` when ``method``
    can prefill sparsely (``prefill: sparse`` or ``auto``: its cost does not grow with the
    prompt, and ``positions`` keep distances inside the trained range) or the trained context is
    not known; else the model's trained context."""
    sparse = settings.prefill == "sparse" or (settings.prefill == "auto" and get(method).sparse_prefill)
    if sparse or not trained or settings.rope_scaling != "none":
        return settings.max_context
    return min(trained, settings.max_context)


def check_generation_room(max_new_tokens: int, limit: int, model_name: str) -> None:
    """``--max-new-tokens`` alone must leave room for a prompt in ``limit`` tokens."""
    if max_new_tokens >= limit:
        raise InputError(
            f"--max-new-tokens {max_new_tokens} leaves no room for the document: prompt and "
            f"generation share {limit} tokens ({model_name}); lower --max-new-tokens")


def check_questions(questions: list[str]) -> None:
    if not questions or any(not q.strip() for q in questions):
        raise InputError("qa needs at least one non-empty question (-q/--question)")
