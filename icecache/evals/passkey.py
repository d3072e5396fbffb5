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


def cases(tokenizer, tokens: int, n: int, seed: int = 0) -> list[PasskeyCase]:
    """``n`` cases at evenly spread depths (0 .. 1), keys drawn from ``seed``."""
    depths = [i / max(1, n - 1) for i in range(n)]
    return [make_case(tokenizer, tokens, d, seed * 1000 + i) for i, d in enumerate(depths)]


def score(output: str, answer: str) -> float:
    m = re.search(r"\d+", output)
    return float(m is not None and m.group(0) == answer)
