"""Passkey retrieval in the Landmark Attention format (raw completion, no chat template).

A 5-digit key sits at a chosen depth inside repeated filler; the prompt ends with "The pass key
is" and the answer is right when the first integer the model writes equals the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
         "them. I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyCase:
    prompt: str
    answer: str
    depth: float
    tokens: int


def make_case(tokenizer, tokens: int, depth: float, seed: int) -> PasskeyCase:
    """About ``tokens`` prompt tokens, the needle after ``depth`` (0..1) of the filler."""
    key = str(int(np.random.default_rng(seed).integers(10000, 99999)))
    per = len(tokenizer(" " + FILLER)["input_ids"])
    fixed = len(tokenizer(f"{INTRO} {NEEDLE.format(key=key)} {QUESTION}")["input_ids"])
    reps = max(1, (tokens - fixed) // per)
    before = int(round(depth * reps))
    parts = [INTRO] + [FILLER] * before + [NEEDLE.format(key=key)] + [FILLER] * (reps - before)
    prompt = " ".join(parts) + "\n" + QUESTION
    return PasskeyCase(prompt=prompt, answer=key, depth=depth,
                       tokens=len(tokenizer(prompt)["input_ids"]))


def spread(n: int, depths: list[float] | None = None) -> list[float]:
    """The depth of each of ``n`` cases.

    Without ``depths``: evenly spread over 0 .. 1. With a list (the paper's sweep is 0, 0.05, ...,
    0.95): ``n`` at least its length cycles through it, so every depth gets ``n // len`` or one
    more cases; a smaller ``n`` takes ``n`` depths evenly spread over the list, both ends included.
    """
    if not depths:
        return [i / max(1, n - 1) for i in range(n)]
    m = len(depths)
    if n >= m:
        return [depths[i % m] for i in range(n)]
    return [depths[round(i * (m - 1) / max(1, n - 1))] for i in range(n)]


def parse_depths(text: str) -> list[float]:
    """``--depths``: percents, comma-separated (``0,25,50``) or a range ``FROM:TO:STEP``
    (``0:95:5``, both ends included). Returns fractions of 1, in order, without repeats."""
    text = text.strip()
    try:
        if ":" in text:
            lo, hi, step = (float(x) for x in text.split(":"))
            if step <= 0:
                raise ValueError
            count = int((hi - lo) / step + 1e-9) + 1
            values = [lo + i * step for i in range(count)]
        else:
            values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"'{text}' is not a list of percents (0,50,100) or a range (0:95:5)") from None
    if not values or any(not 0 <= v <= 100 for v in values):
        raise ValueError(f"'{text}': depths are percents from 0 to 100")
    return sorted({round(v / 100, 6) for v in values})


def cases(tokenizer, tokens: int, n: int, seed: int = 0,
          depths: list[float] | None = None) -> list[PasskeyCase]:
    """``n`` cases at the depths of :func:`spread`, keys drawn from ``seed``."""
    return [make_case(tokenizer, tokens, d, seed * 1000 + i) for i, d in enumerate(spread(n, depths))]


def score(output: str, answer: str) -> float:
    m = re.search(r"\d+", output)
    return float(m is not None and m.group(0) == answer)
