"""GSM8K chain-of-thought at long context: few-shot solved problems pad the prompt to a length.

Problems come from a JSONL file of ``{"question", "answer"}`` with the final number after
``#### `` (the GSM8K test set format; its path is given by ``--data``, nothing is downloaded).
The prompt is raw completion: solved examples ``Question: ...\\nAnswer: ...`` (the calculator
annotations ``<<...>>`` removed) until about ``tokens`` tokens, then the problem. The output is
cut at the next ``Question:``; the prediction is the number after ``####``, else the last number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import read_jsonl


@dataclass(frozen=True)
class Case:
    prompt: str
    answer: str
    tokens: int


def load(path: str | Path) -> list[dict]:
    rows = read_jsonl(path, lambda r: {"question": r["question"], "answer": r["answer"]},
                      "question and answer")
    if len(rows) < 2:
        raise InputError(f"--data: {path}: needs at least 2 problems")
    return rows


def _clean(solution: str) -> str:
    return re.sub(r"<<[^>]*>>", "", solution).strip()


def gold(answer: str) -> str:
    return _number(answer.split("####")[-1])


def _number(text: str) -> str:
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
    if not nums:
        return ""
    n = nums[-1].replace(",", "").rstrip(".")
    return n[:-2] if n.endswith(".0") else n


def predict(output: str) -> str:
    output = output.split("Question:")[0]
    if "####" in output:
        after = re.findall(r"-?\d[\d,]*\.?\d*", output.split("####", 1)[1])
        if after:
            return _number(after[0])
    return _number(output)


def cases(rows: list[dict], tokenizer, tokens: int, n: int, seed: int = 0) -> list[Case]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(rows))
    tests, pool = order[:n], order[n:]
    out = []
    for j, t in enumerate(tests):
        tail = f"Question: {rows[t]['question']}\nAnswer:"
        budget = tokens - len(tokenizer(tail)["input_ids"])
        shots, used = [], 0
        for s in np.roll(pool, -j * 7):
            shot = f"Question: {rows[s]['question']}\nAnswer: {_clean(rows[s]['answer'])}\n\n"
            cost = len(tokenizer(shot)["input_ids"])
            if used + cost > budget:
                break
            shots.append(shot)
            used += cost
        prompt = "".join(shots) + tail
        out.append(Case(prompt, gold(rows[t]["answer"]), len(tokenizer(prompt)["input_ids"])))
    return out


def score(output: str, answer: str) -> float:
    return float(predict(output) == answer)
