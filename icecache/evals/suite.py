"""The prompt suite: documents of several kinds, each with questions whose answers it states, to
judge the task wordings (:data:`icecache.prompts.QA_WORDINGS`) on more than one generator.

Every kind is generated from a seed (no downloads) at about a requested number of tokens, the
asked fact at a chosen depth, and is asked through the same prompts ``icecache qa`` and
``icecache cot`` use. A question's style alternates between cases (but the passkey format's, which
is standard), so a wording is not judged on one phrasing. Scoring is by exact answer: a number must appear as a whole number, a phrase as
whole words (:func:`answered`); a cot case compares the extracted final answer.

Kinds:

- ``passkey_doc``: the passkey format of the paper and of kvpress (an intro, "The grass is
  green. ..." filler, "The pass key is N. Remember it. N is the pass key.").
- ``code_prose``: a door code stated once in varied prose full of other numbers.
- ``locker_list``: a numbered list of library returns with one locker number among them.
- ``fact_prose``: a plain fact about a person (a colour, a pet's name, a home town) in prose.
- ``report``: the long report of three planted facts (near its start, middle and end), every
  fact asked: the generator the qa wording was first tuned on.
- ``log``: a service log with one error code among routine lines.
- ``table``: a table of towns, populations and areas; the population of one town is asked.
- ``memo``: a file of short memos; who sent the memo on one subject.
- ``cot``: an arithmetic word problem after background prose, solved step by step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..prompts import extract_answer
from ..textgen import generated_text
from .passkey import FILLER as PASSKEY_FILLER  # the filler and needle sentences of that format
from .passkey import NEEDLE as PASSKEY_NEEDLE

KINDS = ("passkey_doc", "code_prose", "locker_list", "fact_prose", "report", "log", "table", "memo", "cot")

# The passkey format as the paper and kvpress write it.
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")

# The long report's facts: (share of the document before the fact, the sentence, the question,
# the answer's words).
REPORT_FACTS = (
    (0.03, "Important note: the secret code of the harbor office is 48213.",
     "What is the secret code of the harbor office?", "48213"),
    (0.50, "Important note: the lighthouse keeper's cat is named Pepper.",
     "What is the name of the lighthouse keeper's cat?", "Pepper"),
    (0.97, "Important note: the ferry to Varno Island is called the Silver Heron.",
     "What is the ferry to Varno Island called?", "Silver Heron"),
)

FIRST = ["Ines", "Tomas", "Marta", "Olek", "Hanna", "Ravi", "Lucia", "Emil", "Sade", "Pieter", "Yara", "Konrad"]
LAST = ["Duarte", "Lindgren", "Okafor", "Brandt", "Moreau", "Sato", "Kowalski", "Haddad", "Novak", "Reyes"]
PLACES = ["north gate", "archive room", "staff garage", "server cabinet", "boat shed", "west stairwell"]
COLOURS = ["teal", "maroon", "amber", "lilac", "turquoise", "crimson", "olive", "saffron"]
PETS = ["Biscuit", "Juniper", "Pickle", "Marlowe", "Tansy", "Rocket", "Clover", "Nutmeg"]
TOWNS = ["Harrowgate", "Velden", "Ostrava Mill", "Kestrel Bay", "Linmouth", "Dunmore", "Ashcombe", "Thornby"]
SERVICES = ["scheduler", "mailer", "billing", "auth", "backup", "indexer", "gateway", "reports"]
ROUTINE = ["job {n} finished in {m} s", "health check passed ({m} ms)", "cache hit ratio {m}%",
           "queue length {m}", "connection pool at {m} of 100", "rotated log file {n}.gz",
           "user {n} signed in", "request {n} served in {m} ms"]
SUBJECTS = ["the parking changes", "the new coffee machine", "the spring audit", "the fire drill",
            "the server move", "the holiday rota", "the printer budget", "the visitor badges",
            "the roof repairs", "the training day", "the lost keys", "the canteen menu"]
SYLLABLES = ["bar", "ven", "tor", "lis", "mak", "dor", "quin", "sel", "hal", "rim", "pon", "zet", "lu", "gra"]
GOODS = [("boxes", "apples", "gives away"), ("crates", "lemons", "sells"), ("bags", "marbles", "loses"),
         ("trays", "rolls", "sells"), ("packs", "pencils", "hands out")]


QA_TOKENS, COT_TOKENS = 24, 256  # generation room: a one-sentence answer; a short worked solution


def task_of(kind: str) -> str:
    """The task a kind is asked through: ``qa`` or ``cot`` (whose wordings it compares)."""
    return "cot" if kind == "cot" else "qa"


@dataclass(frozen=True)
class Ask:
    question: str
    expected: str  # a number, or words that must all appear


@dataclass(frozen=True)
class DocCase:
    kind: str
    document: str
    asks: tuple[Ask, ...]
    task: str = "qa"  # or "cot": the document is the problem, the answer its final number
    depth: float | None = None  # where the asked fact sits (0 .. 1); None: several or none


_NUMBERS = re.compile(r"\d[\d,]*")
_WORDS = re.compile(r"[a-z0-9]+")


def answered(output: str, expected: str) -> bool:
    """Whether ``output`` states ``expected``: a number as a whole number (thousands commas
    allowed), otherwise every word of it as a whole word, case aside."""
    if expected.isdigit():
        return any(m.replace(",", "") == expected for m in _NUMBERS.findall(output))
    have = set(_WORDS.findall(output.lower()))
    return all(w in have for w in _WORDS.findall(expected.lower()))


def score(case: DocCase, ask: Ask, output: str) -> float:
    if case.task == "cot":
        return float(extract_answer(output) == ask.expected)
    return float(answered(output, ask.expected))


def _fill(tokenizer, tokens: int, unit, needle: str, depth: float, head: str = "", sep: str = " ") -> str:
    """``head``, then units from ``unit()`` up to about ``tokens`` tokens in all, with ``needle``
    placed after ``depth`` (0 .. 1) of them."""
    count = lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    room = tokens - count(head) - count(needle)
    units, used = [], 0
    while used < room:
        u = unit()
        units.append(u)
        used += count(u) + 1
    if len(units) > 1:
        units.pop()  # (the last one went over)
    at = int(round(depth * len(units)))
    parts = units[:at] + [needle] + units[at:]
    return (head + sep if head else "") + sep.join(parts)


def _sentences(rng):
    """An endless supply of generated prose sentences (varied, full of numbers)."""
    text = generated_text(4000, seed=int(rng.integers(2**31)))
    pieces = [s.strip() + "." for s in text.replace("\n\n", " ").split(".") if s.strip()]
    i = 0

    def unit() -> str:
        nonlocal i
        i += 1
        return pieces[(i - 1) % len(pieces)]

    return unit


def _name(rng) -> str:
    return f"{FIRST[rng.integers(len(FIRST))]} {LAST[rng.integers(len(LAST))]}"


def make(kind: str, tokenizer, tokens: int, index: int, seed: int = 0, depth: float = 0.5) -> DocCase:
    """Case ``index`` of ``kind``: a document of about ``tokens`` tokens, the asked fact after
    ``depth`` (0 .. 1) of it; the question's style alternates with ``index``."""
    rng = np.random.default_rng([seed, index, KINDS.index(kind)])
    style, d = index % 2, depth
    if kind == "passkey_doc":
        key = str(int(rng.integers(10000, 99999)))
        doc = _fill(tokenizer, tokens, lambda: PASSKEY_FILLER, PASSKEY_NEEDLE.format(key=key), d, PASSKEY_INTRO)
        # (the format's own question, in every case: it is the standard one)
        return DocCase(kind, doc, (Ask("What is the pass key?", key),), depth=d)
    if kind == "code_prose":
        key, place = str(int(rng.integers(1000, 9999))), PLACES[rng.integers(len(PLACES))]
        doc = _fill(tokenizer, tokens, _sentences(rng), f"The door code of the {place} is {key}.", d)
        q = (f"What is the door code of the {place}?", f"Which code opens the door of the {place}?")[style]
        return DocCase(kind, doc, (Ask(q, key),), depth=d)
    if kind == "locker_list":
        who, key = _name(rng), str(int(rng.integers(100, 999)))
        days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
        line = [0]

        def unit() -> str:
            line[0] += 1
            return (f"{line[0]}. {_name(rng)} returned {int(rng.integers(1, 9))} books on "
                    f"{days[rng.integers(5)]}, shelf {int(rng.integers(1, 40))}.")

        doc = _fill(tokenizer, tokens, unit, f"Note: the locker number of {who} is {key}.", d,
                    "Library returns, spring term:", sep="\n")
        q = (f"What is the locker number of {who}?", f"Which locker does {who} have?")[style]
        return DocCase(kind, doc, (Ask(q, key),), depth=d)
    if kind == "fact_prose":
        who = _name(rng)
        fact = int(rng.integers(3))
        if fact == 0:
            value = COLOURS[rng.integers(len(COLOURS))]
            needle = f"{who}'s favourite colour is {value}."
            q = (f"What is {who}'s favourite colour?", f"Which colour does {who} like best?")[style]
        elif fact == 1:
            value = PETS[rng.integers(len(PETS))]
            needle = f"{who} has a dog named {value}."
            q = (f"What is the name of {who}'s dog?", f"What is {who}'s dog called?")[style]
        else:
            value = TOWNS[rng.integers(len(TOWNS))]
            needle = f"{who} grew up in the town of {value}."
            q = (f"In which town did {who} grow up?", f"Where did {who} grow up?")[style]
        doc = _fill(tokenizer, tokens, _sentences(rng), needle, d)
        return DocCase(kind, doc, (Ask(q, value),), depth=d)
    if kind == "report":
        doc = report_document(tokens, seed * 1000 + index + 1, tokenizer)
        return DocCase(kind, doc, tuple(Ask(q, a) for _s, _f, q, a in REPORT_FACTS))
    if kind == "log":
        service, key = SERVICES[rng.integers(len(SERVICES))], str(int(rng.integers(1000, 9999)))
        stamp = "2026-03-14 00:00:00"  # (each line's time is set in order once they are placed)

        def unit() -> str:
            svc = SERVICES[rng.integers(len(SERVICES))]
            what = ROUTINE[rng.integers(len(ROUTINE))].format(n=int(rng.integers(100, 99999)),
                                                              m=int(rng.integers(1, 99)))
            return f"{stamp} INFO {svc}: {what}"

        needle = f"{stamp} ERROR {service}: the nightly run failed with error code {key}"
        lines = _fill(tokenizer, tokens, unit, needle, d, sep="\n").split("\n")
        t = int(rng.integers(0, 3600))
        for j, line in enumerate(lines):
            t += int(rng.integers(1, 40))
            lines[j] = f"2026-03-14 {t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}" + line[len(stamp):]
        q = (f"What error code did the {service} service report?",
             f"Which error code appears when the {service} service failed?")[style]
        return DocCase(kind, "\n".join(lines), (Ask(q, key),), depth=d)
    if kind == "table":
        seen: set[str] = set()

        def town() -> str:
            while True:
                t = "".join(rng.choice(SYLLABLES, int(rng.integers(2, 4))).tolist()).capitalize()
                if t not in seen:
                    seen.add(t)
                    return t

        def row() -> str:
            return f"| {town()} | {int(rng.integers(1000, 99999))} | {int(rng.integers(5, 400))} |"

        target, pop = town(), str(int(rng.integers(1000, 99999)))
        doc = _fill(tokenizer, tokens, row, f"| {target} | {pop} | {int(rng.integers(5, 400))} |", d,
                    "| Town | Population | Area (km2) |\n|---|---|---|", sep="\n")
        q = (f"What is the population of {target}?", f"How many people live in {target}?")[style]
        return DocCase(kind, doc, (Ask(q, pop),), depth=d)
    if kind == "memo":
        order = rng.permutation(len(SUBJECTS)).tolist()
        subject, sender = SUBJECTS[order[0]], _name(rng)
        others = [SUBJECTS[i] for i in order[1:]]
        prose = _sentences(rng)

        def memo(subj: str, frm: str) -> str:
            return (f"MEMO\nTo: all staff\nFrom: {frm}\nDate: {int(rng.integers(1, 28))} May\n"
                    f"Subject: {subj}\n\n{prose()} {prose()}\n")

        def unit() -> str:
            who = _name(rng)
            while who == sender:
                who = _name(rng)
            return memo(others[rng.integers(len(others))], who)

        doc = _fill(tokenizer, tokens, unit, memo(subject, sender), d, sep="\n")
        q = (f"Who sent the memo about {subject}?", f"Who wrote the memo on {subject}?")[style]
        return DocCase(kind, doc, (Ask(q, sender),), depth=d)
    if kind == "cot":
        who = FIRST[rng.integers(len(FIRST))]
        box, item, verb = GOODS[rng.integers(len(GOODS))]
        a, b = int(rng.integers(3, 13)), int(rng.integers(4, 13))
        c = int(rng.integers(1, a * b))
        problem = (f"Problem: {who} has {a} {box} with {b} {item} in each. {who} {verb} {c} {item}. "
                   f"How many {item} does {who} have left?")
        head = "Background notes:"
        doc = _fill(tokenizer, max(0, tokens - 60), _sentences(rng), "", 1.0, head) if tokens > 120 else ""
        return DocCase(kind, (doc.rstrip() + "\n\n" + problem).strip(), (Ask("", str(a * b - c)),),
                       task="cot")
    raise ValueError(f"unknown kind {kind}")


def report_document(tokens: int, seed: int, tokenizer=None) -> str:
    """Generated prose of about ``tokens`` tokens with :data:`REPORT_FACTS` planted at their
    shares, each after a sentence's end. With ``tokenizer``, at most ``tokens`` of its tokens
    (the prose's words make about 1.33 tokens each, a little more for some tokenizers)."""
    text = generated_text(int(tokens * 0.75), seed=seed)

    def planted(prose: str) -> str:
        out, last = [], 0
        for share, sentence, _q, _a in REPORT_FACTS:
            at = prose.find(". ", int(len(prose) * share)) + 2
            out += [prose[last:at], sentence + " "]
            last = at
        out.append(prose[last:])
        return "".join(out)

    doc = planted(text)
    while tokenizer is not None and (have := len(tokenizer(doc)["input_ids"])) > tokens:
        # cut the prose by the excess and a little more, at a sentence's end
        cut = text.rfind(". ", 0, int(len(text) * (1 - (have - tokens + 4) / have))) + 2
        if cut < 2:  # no sentence left to cut: the facts alone are longer than asked
            break
        text = text[:cut]
        doc = planted(text)
    return doc


def cases(kind: str, tokenizer, tokens: int, n: int, seed: int = 0) -> list[DocCase]:
    """``n`` cases of ``kind``, the asked fact at evenly spread depths: the middle of each of
    ``n`` equal slices of the document (``n`` = 10: 5%, 15%, ..., 95%)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind}")
    return [make(kind, tokenizer, tokens, i, seed, (i + 0.5) / n) for i in range(n)]


def parse_wordings(values: list[str]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``eval --prompt`` values: a wording's name (:data:`icecache.prompts.WORDINGS`) or
    ``LABEL=TEMPLATE`` (a template of one's own, its task told by its slot). Returns the labels
    per task, in order, and each own template by its label. ``ValueError`` for a bad value."""
    from ..prompts import SLOTS, WORDINGS

    per_task: dict[str, list[str]] = {}
    own: dict[str, str] = {}
    for value in values:
        label, eq, template = value.partition("=")
        label = label.strip()
        if eq:
            tasks = [t for t, slot in SLOTS.items() if slot in template]
            if not label or len(tasks) != 1:
                raise ValueError(f"'{value}': LABEL=TEMPLATE needs a label and one of "
                                 f"{', '.join(SLOTS.values())} in the template")
            if any(label in names for names in WORDINGS.values()):
                raise ValueError(f"'{label}' already names a built-in wording; choose another label")
            task = tasks[0]
            own[label] = template
        else:
            tasks = [t for t, names in WORDINGS.items() if label in names]
            if not tasks:
                known = ", ".join(f"{t}: {', '.join(names)}" for t, names in WORDINGS.items())
                raise ValueError(f"'{label}' is not a wording ({known}); or give LABEL=TEMPLATE")
            task = tasks[0]
        if label in per_task.get(task, []):
            raise ValueError(f"'{label}' is named twice")
        per_task.setdefault(task, []).append(label)
    return per_task, own
