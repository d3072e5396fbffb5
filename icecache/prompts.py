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


# The task wordings: for qa, what follows the document (``{question}`` where the question goes);
# for cot, the whole message (``{problem}``). ``icecache eval --tasks prompts --prompt NAME ...``
# compares them over the prompt suite's kinds of document, and :data:`SHIPPED` names the ones
# the commands use: for qa, the wording with the best worst kind inside the trained context
# that loses no kind beyond it (docs/prompts.md has the tables). ``earlier`` ties the best worst
# kind inside among the wordings that hold up beyond the trained context, and finds the most
# there (every report fact at 32k, more lockers and door codes at 16k); it is also the one a
# base model without a chat template answers with. ``brief``, chosen before on generated reports
# alone, answered standard passkey documents by echoing the question ("The pass key is the pass
# key."); ``lead`` and ``short`` do best on some kinds inside but open their answers with talk
# about the question beyond it or on passkeys.
WORDINGS = {
    "qa": {
        "find-cue": "Find the answer to this question in the document above: {question}\nAnswer:",
        "brief": "Using the document above, answer the question below as briefly as possible: one "
                 "phrase or one sentence.\n\nQuestion: {question}\nAnswer:",
        "earlier": "Answer this question about the document above: {question}",
        "lead": "Answer this question about the document above, starting with the answer: {question}",
        "read": "Read the document above and answer this question: {question}",
        "short": "Answer this question about the document above in one short sentence: {question}",
    },
    "cot": {
        "steps": "{problem}\n\nSolve this step by step. Finish with a last line of the form "
                 "'Answer: <final answer>'.",
        "think": "{problem}\n\nThink it through step by step, then give the final number on a last "
                 "line 'Answer: N'.",
    },
}
SHIPPED = {"qa": "earlier", "cot": "steps"}
SLOTS = {"qa": "{question}", "cot": "{problem}"}


def wording(task: str, name_or_template: str | None = None) -> str:
    """The template of ``task``'s wording ``name_or_template``: a name of :data:`WORDINGS`, a
    template of one's own (holding the task's slot, :data:`SLOTS`), or None for the shipped one.
    ``ValueError`` for anything else."""
    known = WORDINGS[task]
    name = SHIPPED[task] if name_or_template is None else name_or_template
    if name in known:
        return known[name]
    if SLOTS[task] not in name:
        raise ValueError(f"'{name}' is neither a {task} wording ({', '.join(known)}) nor a template "
                         f"with {SLOTS[task]}")
    return name


def qa_messages(document: str, question: str, name: str | None = None) -> Messages:
    """The question after the document, in the wording ``name`` (:func:`wording`; None: shipped)."""
    text = wording("qa", name).replace("{question}", question.strip())
    return [{"role": "user", "content": f"Here is a document.\n\n{document.strip()}\n\n{text}"}]


ANSWER_CUE = "Answer:"  # where a reply starts, for a base model too (:func:`render`)
# the labels of the prompts' lines: a plain-text reply that starts a line with one has ended
# (:func:`~icecache.chat.stop_cues`)
CUE_LABELS = ("Question:", ANSWER_CUE)


def cot_messages(problem: str, name: str | None = None) -> Messages:
    """The problem and the request to solve it, in the wording ``name`` (:func:`wording`; None: shipped)."""
    return [{"role": "user", "content": wording("cot", name).replace("{problem}", problem.strip())}]


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
