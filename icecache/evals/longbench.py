"""LongBench-style scoring for any JSONL of ``{"context", "question", "answers"}``.

``qa_f1``: token F1 after LongBench's normalization (lower case, punctuation and the articles
a/an/the removed, whitespace collapsed), best over the reference answers. ``rouge_l``: ROUGE-L F
from the ``rouge-score`` package, best over the answers. Prompts go through the ``qa`` task's
chat template, as ``icecache qa`` would ask.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from pathlib import Path

from ..errors import InputError
from . import read_jsonl


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1(prediction: str, answers) -> float:
    best = 0.0
    pred = normalize(prediction).split()
    for a in answers:
        ref = normalize(a).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if not pred or not ref or common == 0:
            continue
        p, r = common / len(pred), common / len(ref)
        best = max(best, 2 * p * r / (p + r))
    return best


def rouge_l(prediction: str, answers) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    return max((scorer.score(a, prediction)["rougeL"].fmeasure for a in answers), default=0.0)


def _row(r: dict) -> dict:
    answers = r["answers"]
    if isinstance(answers, str):
        answers = [answers]
    return {"context": str(r["context"]), "question": str(r["question"]),
            "answers": [str(a) for a in answers]}


def load(path: str | Path) -> list[dict]:
    rows = read_jsonl(path, _row, "context, question and answers")
    if not rows:
        raise InputError(f"--data: {path}: no rows")
    return rows
