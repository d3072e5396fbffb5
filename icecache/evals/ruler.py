"""RULER-style synthetic tasks, generated from a seed (no downloads), in raw completion form.

Each generator returns cases of about ``tokens`` prompt tokens; a case's score is the fraction of
its expected strings found in the model's output (RULER's string-match metric).

- ``niah_single``: one 7-digit "special magic number" for a key, in a noise haystack.
- ``niah_multikey``: the same with distractor needles for other keys.
- ``niah_multivalue``: several numbers for one key; all are expected.
- ``niah_prose``: ``niah_single`` in a haystack of varied prose full of other numbers
  (:func:`icecache.textgen.generated_text`; RULER's essay haystack plays this part), the needle
  between two sentences: harder than the repeated noise, and closer to a real report.
- ``vt``: variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... in noise; all
  names in the chain are expected.
- ``fwe``: frequent-words extraction over a coded text of random words with skewed counts; the
  three most frequent words are expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
         "them. I will quiz you about the numbers afterwards.")
WORDS = ("apple river stone cloud lamp horse window garden silver paper candle mirror forest "
         "ladder anchor basket pepper marble violet tunnel harbor meadow copper lantern").split()
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "fwe", "niah_prose")
DEPTHS = ("niah_single", "niah_prose")  # tasks whose needle sits at a chosen depth


@dataclass(frozen=True)
class Case:
    prompt: str
    expected: tuple[str, ...]
    tokens: int
    depth: float | None = None  # niah_single: where its needle sits (0 .. 1)


def score(output: str, expected) -> float:
    return sum(e in output for e in expected) / len(expected)


def _haystack(tokenizer, tokens: int, fixed: str, inserts: list[str], rng, depth: float | None = None) -> str:
    """Noise sentences to about ``tokens`` in all, with ``inserts`` placed among them."""
    per = len(tokenizer(" " + NOISE)["input_ids"])
    reps = max(len(inserts) + 1, (tokens - len(tokenizer(fixed + " ".join(inserts))["input_ids"])) // per)
    if depth is not None and len(inserts) == 1:
        spots = [int(round(depth * reps))]
    else:
        spots = sorted(rng.choice(reps + 1, len(inserts), replace=False).tolist())
    parts, j = [], 0
    for r in range(reps + 1):
        while j < len(inserts) and spots[j] == r:
            parts.append(inserts[j])
            j += 1
        if r < reps:
            parts.append(NOISE)
    return " ".join(parts)


def _prose(tokenizer, tokens: int, fixed: str, insert: str, depth: float, seed: int) -> str:
    """Generated prose of about ``tokens`` in all, with ``insert`` between two of its sentences
    at ``depth`` (0 .. 1) of them."""
    from ..textgen import generated_text

    room = tokens - len(tokenizer(fixed + " " + insert)["input_ids"])
    text = generated_text(max(20, int(room * 0.75)), seed=seed)  # about 1.33 tokens per word
    have = len(tokenizer(text)["input_ids"])
    if have > room:  # trim to the room left, at a sentence's end
        text = text[: max(1, int(len(text) * room / have))]
        text = text[: text.rfind(".") + 1] or text
    ends = [i + 1 for i, c in enumerate(text) if c == "." and (i + 1 == len(text) or text[i + 1] == " ")]
    if depth <= 0 or not ends:
        at = 0 if depth <= 0 else len(text)
    else:
        at = ends[int(round(depth * (len(ends) - 1)))]
    return (text[:at] + " " + insert + " " + text[at:].lstrip()).strip()


def _key(rng) -> str:
    return "-".join(rng.choice(WORDS, 2, replace=False).tolist())


def _number(rng) -> str:
    return str(int(rng.integers(1_000_000, 9_999_999)))


def make(task: str, tokenizer, tokens: int, index: int, n: int, seed: int,
         depth: float | None = None) -> Case:
    """Case ``index`` of ``n``; niah_single's needle at ``depth`` (default: evenly spread)."""
    rng = np.random.default_rng([seed, index, TASKS.index(task)])
    if depth is None:
        depth = index / max(1, n - 1)
    if task in ("niah_single", "niah_multikey", "niah_multivalue"):
        key = _key(rng)
        if task == "niah_multivalue":
            values = [_number(rng) for _ in range(3)]
            inserts = [f"One of the special magic numbers for {key} is: {v}." for v in values]
            question = (f"What are all the special magic numbers for {key} mentioned in the provided text? "
                        f"The special magic numbers for {key} mentioned in the provided text are")
            expected = values
        else:
            value = _number(rng)
            inserts = [f"One of the special magic numbers for {key} is: {value}."]
            if task == "niah_multikey":
                others = set()
                while len(others) < 3:
                    k = _key(rng)
                    if k != key:
                        others.add(k)
                inserts += [f"One of the special magic numbers for {k} is: {_number(rng)}." for k in sorted(others)]
                rng.shuffle(inserts)
            question = (f"What is the special magic number for {key} mentioned in the provided text? "
                        f"The special magic number for {key} mentioned in the provided text is")
            expected = [value]
        body = _haystack(tokenizer, tokens, INTRO + question, inserts, rng,
                         depth if task == "niah_single" else None)
        prompt = f"{INTRO} {body}\n{question}"
    elif task == "niah_prose":
        key, value = _key(rng), _number(rng)
        insert = f"One of the special magic numbers for {key} is: {value}."
        question = (f"What is the special magic number for {key} mentioned in the provided text? "
                    f"The special magic number for {key} mentioned in the provided text is")
        body = _prose(tokenizer, tokens, INTRO + question, insert, depth, int(rng.integers(2**31)))
        prompt = f"{INTRO} {body}\n{question}"
        expected = [value]
    elif task == "vt":
        value = str(int(rng.integers(10000, 99999)))
        names = ["".join(rng.choice(list("ABCDEFGHJKLMNPQRSTUVWXYZ"), 5).tolist()) for _ in range(4)]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        question = (f"Find all variables that are assigned the value {value} in the text above. "
                    f"According to the chain of variable assignments in the text above, 4 variables "
                    f"are assigned the value {value}, they are:")
        intro = "Memorize and track the chain of variable assignments hidden in the following text."
        body = _haystack(tokenizer, tokens, intro + question, chain, rng)
        prompt = f"{intro} {body}\n{question}"
        expected = names
    elif task == "fwe":
        vocab = rng.choice(WORDS, 12, replace=False).tolist()
        weights = np.array([30, 24, 19] + [8] * 9, float)
        intro = ("Read the following coded text and track the frequency of each coded word. "
                 "Find the three most frequently appeared coded words.")
        question = ("What are the three most frequently appeared words in the above coded text? "
                    "Answer: According to the coded text above, the three most frequently appeared words are:")
        per = len(tokenizer(" " + " ".join(vocab))["input_ids"]) / len(vocab)
        count = max(30, int((tokens - len(tokenizer(intro + question)["input_ids"])) / per))
        words = rng.choice(vocab, count, p=weights / weights.sum()).tolist()
        prompt = f"{intro} {' '.join(words)}\n{question}"
        freq = {w: words.count(w) for w in vocab}
        expected = sorted(vocab, key=lambda w: -freq[w])[:3]
    else:
        raise ValueError(f"unknown task {task}")
    return Case(prompt, tuple(expected), len(tokenizer(prompt)["input_ids"]),
                depth if task in DEPTHS else None)


def cases(task: str, tokenizer, tokens: int, n: int, seed: int = 0,
          depths: list[float] | None = None) -> list[Case]:
    """``n`` cases; niah_single's needles at :func:`passkey.spread` depths."""
    from .passkey import spread

    at = spread(n, depths) if task in DEPTHS else [None] * n
    return [make(task, tokenizer, tokens, i, n, seed, at[i]) for i in range(n)]
