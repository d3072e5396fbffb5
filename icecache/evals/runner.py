"""Evaluation cells (task x method x budget x length), each scored and written as it finishes.

Results go to ``OUT/results.jsonl`` (one line per finished cell, flushed), next to
``OUT/config.json``; a rerun with the same ``--out`` skips the cells already there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..generation import Session
from ..index.capture import generated_text
from ..prompts import qa_messages, render, summarize_messages
from . import fidelity, passkey, ruler

TASKS = ("passkey", *ruler.TASKS, "gsm8k", "longbench", "fidelity")
DATA_TASKS = ("gsm8k", "longbench")  # these read --data
NEW_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "vt": 40, "fwe": 24}
BUDGETLESS = ("full", "streaming")  # streaming keeps sink + window only


@dataclass(frozen=True)
class Cell:
    task: str
    method: str
    budget: int
    length: int

    def key(self) -> tuple:
        return (self.task, self.method, self.budget, self.length)


def cells(tasks, methods, budgets, lengths) -> list[Cell]:
    out = []
    for task in tasks:
        for length in lengths:
            for method in methods:
                for budget in ([0] if method in BUDGETLESS else budgets):
                    out.append(Cell(task, method, budget, length))
    return out


def _settings(base, cell: Cell):
    return base if cell.budget == 0 else base.replace(budget=cell.budget)


def fidelity_prompts(tokenizer, length: int, n: int, seed: int) -> list[list[int]]:
    """``n`` summarize prompts over generated documents of about ``length`` tokens."""
    out = []
    for i in range(n):
        words = int(length * 0.7)
        doc = generated_text(words, seed * 100 + i)
        ids = render(tokenizer, summarize_messages(doc))
        while len(ids) > length and words > 50:
            words = int(words * 0.95)
            doc = generated_text(words, seed * 100 + i)
            ids = render(tokenizer, summarize_messages(doc))
        out.append(ids)
    return out


class Evaluator:
    def __init__(self, loaded, settings, n: int, seed: int, new_tokens: int = 160,
                 log: Callable[[str], None] = lambda _m: None, data: str | None = None):
        self.loaded, self.settings, self.n, self.seed = loaded, settings, n, seed
        self.data = data
        self.new_tokens = new_tokens
        self.log = log
        self._refs: dict[int, list] = {}

    def run(self, cell: Cell) -> dict:
        if cell.task == "passkey":
            return self._passkey(cell)
        if cell.task == "fidelity":
            return self._fidelity(cell)
        if cell.task in ruler.TASKS:
            return self._ruler(cell)
        if cell.task == "gsm8k":
            return self._gsm8k(cell)
        if cell.task == "longbench":
            return self._longbench(cell)
        raise ValueError(cell.task)

    def _gsm8k(self, cell: Cell) -> dict:
        from . import gsm8k

        if self.data is None:
            raise UsageError("the gsm8k task needs --data PATH (a JSONL file of GSM8K problems)")
        cases = gsm8k.cases(gsm8k.load(self.data), self.loaded.tokenizer, cell.length, self.n, self.seed)
        return self._generated(cell, cases, self.new_tokens, lambda out, c: gsm8k.score(out, c.answer))

    def _longbench(self, cell: Cell) -> dict:
        """The first ``n`` rows of the file (``length`` only names the cell: rows keep theirs)."""
        from . import longbench

        if self.data is None:
            raise UsageError("the longbench task needs --data PATH (JSONL of context, question, answers)")
        tok = self.loaded.tokenizer
        settings = _settings(self.settings, cell)
        f1s, rouges = [], []
        for row in longbench.load(self.data)[: self.n]:
            ids = render(tok, qa_messages(row["context"], row["question"]))
            out, _ = Session(self.loaded, settings, cell.method).generate(ids, 64)
            text = tok.decode(out)
            f1s.append(longbench.qa_f1(text, row["answers"]))
            rouges.append(longbench.rouge_l(text, row["answers"]))
        return {"score": sum(f1s) / len(f1s), "n": len(f1s), "rouge_l": sum(rouges) / len(rouges)}

    def _ruler(self, cell: Cell) -> dict:
        cases = ruler.cases(cell.task, self.loaded.tokenizer, cell.length, self.n, self.seed)
        return self._generated(cell, cases, NEW_TOKENS[cell.task], lambda out, c: ruler.score(out, c.expected))

    def _generated(self, cell: Cell, cases, new_tokens: int, score) -> dict:
        """Each case's prompt through a fresh session of the cell's method, scored."""
        tok = self.loaded.tokenizer
        settings = _settings(self.settings, cell)
        scores = []
        for case in cases:
            out, _ = Session(self.loaded, settings, cell.method).generate(
                tok(case.prompt)["input_ids"], new_tokens)
            scores.append(score(tok.decode(out), case))
        return {"score": sum(scores) / len(scores), "n": len(scores), "detail": scores}

    def _passkey(self, cell: Cell) -> dict:
        cases = passkey.cases(self.loaded.tokenizer, cell.length, self.n, self.seed)
        return self._generated(cell, cases, 8, lambda out, c: passkey.score(out, c.answer))

    def _fidelity(self, cell: Cell) -> dict:
        if cell.length not in self._refs:
            prompts = fidelity_prompts(self.loaded.tokenizer, cell.length, self.n, self.seed)
            self._refs[cell.length] = [
                fidelity.reference(self.loaded, self.settings, p, self.new_tokens) for p in prompts]
        agree = total = 0
        kl = 0.0
        for ref in self._refs[cell.length]:
            f = fidelity.measure(self.loaded, _settings(self.settings, cell), cell.method, ref)
            agree, total, kl = agree + f.agree, total + f.total, kl + f.kl_sum
        return {"score": agree / max(1, total), "n": total, "mean_kl": kl / max(1, total)}


def load_done(out: Path | None) -> dict[tuple, dict]:
    done = {}
    if out and (out / "results.jsonl").exists():
        for line in (out / "results.jsonl").read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill: that cell runs again
            done[(r["task"], r["method"], r["budget"], r["length"])] = r
    return done


def append(out: Path | None, row: dict) -> None:
    if out is None:
        return
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
