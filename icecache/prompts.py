"""Prompts for the document tasks, and extraction of a chain-of-thought's final answer.

Prompts are chat messages rendered with the model's own chat template. The document always comes
before the task-specific part, so that several questions over one document share a token prefix
and the document's KV cache is computed once.
"""

from __future__ import annotations

import re
from typing import Any

Messages = list[dict[str, str]]


def summarize_messages(document: str) -> Messages:
    return [
        {
            "role": "user",
            "content": f"Here is a document.\n\n{document.strip()}\n\n"
            "Write a concise summary of the document above in a few sentences.",
        }
    ]


def qa_messages(document: str, question: str) -> Messages:
    """The question after the document, asked for a short answer, and the reply's slot marked
    ``Answer:``. Generated long reports at 32k tokens, six documents, three facts each, the
    embedded model with ice at budget 256, from the same prefills: 17 of 18 facts found, where
    the earlier wording ("Answer this question about the document above: Q") found 15, its
    answers opening in the document's voice ("The document suggests that the new lamp ...")
    and not coming back to the fact. At 6k tokens (full attention) it found 14 to the earlier 16,
    the middle fact missed more often (docs/results.md, session 50)."""
    return [
        {
            "role": "user",
            "content": f"Here is a document.\n\n{document.strip()}\n\n"
            "Using the document above, answer the question below as briefly as possible: one "
            f"phrase or one sentence.\n\nQuestion: {question.strip()}\n{ANSWER_CUE}",
        }
    ]


ANSWER_CUE = "Answer:"  # where a reply starts, for a base model too (:func:`render`)


def cot_messages(problem: str) -> Messages:
    return [
        {
            "role": "user",
            "content": f"{problem.strip()}\n\nSolve this step by step. Finish with a last line "
            "of the form 'Answer: <final answer>'.",
        }
    ]


def document_prefix(tokenizer: Any, document: str) -> int:
    """How many leading tokens every summarize and qa prompt over ``document`` shares (the
    template's start and the document): where the document cache cuts."""
    a = render(tokenizer, summarize_messages(document))
    b = render(tokenizer, qa_messages(document, "?"))
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def render(tokenizer: Any, messages: Messages) -> list[int]:
    """Token ids of ``messages`` through the chat template, ready for the assistant's reply.

    A tokenizer without a chat template (a base model) gets the plain contents followed by
    ``Answer:`` (once: a qa prompt ends with it).
    """
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(enc["input_ids"])
    text = "\n\n".join(m["content"] for m in messages)
    if not text.endswith(ANSWER_CUE):  # (a qa prompt ends with it already)
        text += "\n\n" + ANSWER_CUE
    return list(tokenizer(text)["input_ids"])


_ANSWER_LINE = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _clean_number(s: str) -> str:
    s = s.replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


def extract_answer(text: str) -> str:
    """The final answer of a step-by-step solution.

    The last 'Answer: X' / 'the answer is X' wins; if X holds a number, that number (commas
    dropped) is the answer; when X is a worked equation ('3 * 12 = 36'), the number after its last
    '='. Without such a line, the last number in the text; else ''.
    """
    matches = _ANSWER_LINE.findall(text)
    if matches:
        tail = matches[-1].strip()
        numbers = _NUMBER.findall(tail.rsplit("=", 1)[-1])
        if numbers:
            return _clean_number(numbers[0])
        return tail.rstrip(". ").strip("*").strip()
    numbers = _NUMBER.findall(text)
    return _clean_number(numbers[-1]) if numbers else ""
