"""Evaluation cells (task x method x budget x length), each scored and written as it finishes.

Results go to ``OUT/results.jsonl`` (one line per finished cell, flushed), next to
``OUT/config.json``; a rerun with the same ``--out`` skips the cells already there (and refuses
to mix in results made with other cases or settings: :func:`.records.check_resumable`). The
files themselves are read and written by :mod:`.records`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import methods as methods_
from ..errors import UsageError
from ..generation import Session, prefill_once
from ..prompts import qa_messages, render, summarize_messages
from ..textgen import generated_text
from ..variants import base_method
from . import fidelity, passkey, ruler, suite
from .records import append_case, load_cases

TASKS = ("passkey", *ruler.TASKS, "gsm8k", "longbench", "fidelity", *suite.KINDS)
GROUPS = {"prompts": suite.KINDS}  # --tasks prompts: every kind of the prompt suite
DATA_TASKS = ("gsm8k", "longbench")  # these read --data
NEW_TOKENS = {"niah_single": 16, "niah_prose": 16, "niah_multikey": 16, "niah_multivalue": 48, "vt": 40, "fwe": 24}


@dataclass(frozen=True)
class Cell:
    task: str
    method: str
    budget: int
    length: int
    prompt: str = ""  # the prompt suite's kinds: the wording's name ("": the shipped one)

    def key(self) -> tuple:
        return (self.task, self.method, self.budget, self.length, self.prompt)

    @property
    def base(self) -> str:
        """The method the cell runs: ``method`` without a variant's keys ('ice[a=1]' -> 'ice')."""
        return base_method(self.method)


def cells(tasks, methods, budgets, lengths, prompts: dict[str, list[str]] | None = None) -> list[Cell]:
    """Every (task, length, method, budget) cell; a prompt suite kind's cells once per wording of
    its task in ``prompts`` (task -> names; none given: the shipped one)."""
    out = []
    for task in tasks:
        wordings = (prompts or {}).get(suite.task_of(task), []) if task in suite.KINDS else []
        for length in lengths:
            for method in methods:
                for budget in (budgets if methods_.get(base_method(method)).budgeted else [0]):
                    out += [Cell(task, method, budget, length, w) for w in wordings or [""]]
    return out


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
                 log: Callable[[str], None] = lambda _m: None, data: str | None = None,
                 depths: list[float] | None = None, out: Path | None = None, variants: dict | None = None,
                 wordings: dict[str, str] | None = None):
        self.loaded, self.settings, self.n, self.seed = loaded, settings, n, seed
        self.wordings = dict(wordings or {})  # a wording's label -> its template (names stand for themselves)
        # a method label with profile keys changed ('ice[answer_spans=3]') -> its settings
        self.variants = dict(variants or {})
        self.out = out  # with --out: each case's score is kept as it is made (cases.jsonl)
        self._cases = load_cases(out)
        self.depths = depths  # passkey, niah_single, niah_prose: needle depths (None: evenly spread)
        self.data = data
        self.new_tokens = new_tokens
        self.log = log
        self._refs: dict[int, list] = {}
        self._siblings: list[Cell] = []
        self._ahead: dict[tuple, dict] = {}  # rows computed with an earlier cell's group

    def _settings(self, cell: Cell):
        """The settings of ``cell``: its method variant's (``ice[key=value]``) or the run's, at its budget."""
        s = self.variants.get(cell.method, self.settings)
        return s if cell.budget == 0 else s.replace(budget=cell.budget)

    def run(self, cell: Cell, siblings: list[Cell] | tuple = ()) -> dict:
        """Score ``cell``. ``siblings``: cells still to run; those of the same task and length
        may be computed now, case by case with it (then returned when asked for)."""
        ahead = self._ahead.pop(cell.key(), None)
        if ahead is not None:
            return ahead
        self._siblings = list(siblings)
        named = {"passkey": self._passkey, "fidelity": self._fidelity, "gsm8k": self._gsm8k,
                 "longbench": self._longbench}
        run = named.get(cell.task) or (self._ruler if cell.task in ruler.TASKS else
                                       self._suite if cell.task in suite.KINDS else None)
        if run is None:
            raise ValueError(cell.task)
        return run(cell)

    def _suite(self, cell: Cell) -> dict:
        """A prompt suite kind: each case's document asked through the product's own qa or cot
        (:class:`icecache.tasks.Runner`) by every cell of the same kind and length (methods,
        budgets, wordings) before the next case. The document's prefill is shared through a
        document cache of the case's own (a temporary folder, every prompt length), so each
        wording and question costs only its own tokens."""
        import shutil
        import tempfile

        from ..tasks import Runner

        cases = suite.cases(cell.task, self.loaded.tokenizer, cell.length, self.n, self.seed)
        group = [cell] + [c for c in self._siblings
                          if c.key() != cell.key() and (c.task, c.length) == (cell.task, cell.length)]
        scores: dict[tuple, dict[int, float]] = {c.key(): {} for c in group}
        with tempfile.TemporaryDirectory(prefix="icecache-suite-") as tmp:
            for i, case in enumerate(cases):
                for c in group:
                    if (c.key(), i) in self._cases:  # scored by an earlier, interrupted run
                        scores[c.key()][i] = self._cases[(c.key(), i)]
                todo = [c for c in group if i not in scores[c.key()]]
                runners: dict[tuple, Runner] = {}
                for c in todo:
                    if (c.method, c.budget) not in runners:
                        settings = self._settings(c).replace(doc_cache=str(Path(tmp) / str(i)),
                                                             doc_cache_min_tokens=1)
                        runners[(c.method, c.budget)] = Runner(self.loaded, settings, c.base)
                    runner = runners[(c.method, c.budget)]
                    wording = self.wordings.get(c.prompt, c.prompt) or None
                    if case.task == "cot":
                        outputs = [runner.cot(case.document, suite.COT_TOKENS, wording=wording).output]
                    else:
                        outputs = runner.qa(case.document, [a.question for a in case.asks], suite.QA_TOKENS,
                                            wording=wording).output
                    got = [suite.score(case, a, o) for a, o in zip(case.asks, outputs, strict=True)]
                    scores[c.key()][i] = self._cases[(c.key(), i)] = sum(got) / len(got)
                    append_case(self.out, c.key(), i, scores[c.key()][i], " | ".join(outputs),
                                [a.expected for a in case.asks])
                del runners
                shutil.rmtree(Path(tmp) / str(i), ignore_errors=True)
                self.log(f"  case {i + 1}/{len(cases)}: " + ", ".join(
                    f"{scores[c.key()][i]:g} ({_suite_label(c)})" for c in group))
        return self._rows(cell, group, scores, cases, asked=sum(len(c.asks) for c in cases))

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
        settings = self._settings(cell)
        f1s, rouges = [], []
        for row in longbench.load(self.data)[: self.n]:
            ids = render(tok, qa_messages(row["context"], row["question"]))
            out, _ = Session(self.loaded, settings, cell.base).generate(ids, 64)
            text = tok.decode(out)
            f1s.append(longbench.qa_f1(text, row["answers"]))
            rouges.append(longbench.rouge_l(text, row["answers"]))
        return {"score": sum(f1s) / len(f1s), "n": len(f1s), "rouge_l": sum(rouges) / len(rouges)}

    def _ruler(self, cell: Cell) -> dict:
        cases = ruler.cases(cell.task, self.loaded.tokenizer, cell.length, self.n, self.seed, self.depths)
        return self._generated(cell, cases, NEW_TOKENS[cell.task], lambda out, c: ruler.score(out, c.expected))

    def _generated(self, cell: Cell, cases, new_tokens: int, score) -> dict:
        """Each case's prompt decoded by the cell's method; scored.

        The pending cells of the same task and length (:meth:`run`'s ``siblings``: other methods
        and budgets) are computed case by case with it, and their rows kept for when they are
        asked for. A case's prompt is prefilled once (:func:`prefill_once`) for every cell that
        decodes from a shared full prefill, and once per method (its own sparse prefill) for the
        others, whose budgets decode from copies of it where that is exact and fits in memory
        (:meth:`Session.fork`). Only the current case's prefill is held: memory does not grow
        with the number of cases.
        """
        tok = self.loaded.tokenizer
        group = [cell] + [c for c in self._siblings
                          if c.key() != cell.key() and (c.task, c.length) == (cell.task, cell.length)]
        # per cell, case index -> score: a sibling may have cases an earlier run made that this
        # cell lacks, and the other way round (each keeps what it has; the group computes the rest)
        scores: dict[tuple, dict[int, float]] = {c.key(): {} for c in group}
        for i, case in enumerate(cases):
            for c in group:
                if (c.key(), i) in self._cases:  # scored by an earlier, interrupted run
                    scores[c.key()][i] = self._cases[(c.key(), i)]
            if i in scores[cell.key()]:
                self.log(f"  case {i + 1}/{len(cases)}: {scores[cell.key()][i]:g} (from {self.out})")
                continue
            ids = tok(case.prompt)["input_ids"]
            todo = [c for c in group if i not in scores[c.key()]]
            sparse = [c for c in todo if methods_.prefill_mode(
                c.base, self.loaded.model, self._settings(c), len(ids)) == "sparse"]
            shared = [c for c in todo if c not in sparse]
            outs: dict[tuple, list[int]] = {}
            if shared:
                pre = prefill_once(self.loaded, self.settings, ids, new_tokens=new_tokens)
                for c in shared:
                    outs[c.key()] = Session(self.loaded, self._settings(c), c.base).generate_from(pre, new_tokens)[0]
                del pre
            for method in dict.fromkeys(c.method for c in sparse):
                outs.update(self._sparse_group([c for c in sparse if c.method == method], ids, new_tokens))
            for key, out in outs.items():
                text = tok.decode(out)
                scores[key][i] = self._cases[(key, i)] = score(text, case)
                append_case(self.out, key, i, scores[key][i], text, _expected(case))
            done = [c for c in todo if c.key() in outs]  # the cell itself first
            one_method = len({c.method for c in done}) == 1
            self.log(f"  case {i + 1}/{len(cases)}: " + ", ".join(
                f"{scores[c.key()][i]:g}" + (_label(c, one_method) if len(done) > 1 else "") for c in done))
        return self._rows(cell, group, scores, cases)

    def _rows(self, cell: Cell, group: list[Cell], scores: dict[tuple, dict[int, float]], cases,
              asked: int | None = None) -> dict:
        """The rows of ``group``'s cells whose every case is scored (``cell``'s is returned, the
        others kept for when they are asked for); ``asked``: the questions of all cases."""
        rows = {}
        for c in group:
            if len(scores[c.key()]) != len(cases):
                continue  # not computed with this group: runs on its own
            got = [scores[c.key()][i] for i in range(len(cases))]
            row = {"score": sum(got) / len(got), "n": len(got), "detail": got}
            if asked is not None:
                row["asked"] = asked
            if getattr(cases[0], "depth", None) is not None:
                row["depths"] = [x.depth for x in cases]  # for the length x depth picture
            rows[c.key()] = row
        for key, row in rows.items():
            if key != cell.key():
                self._ahead[key] = row
        return rows[cell.key()]

    def _sparse_group(self, group: list[Cell], ids: list[int], new_tokens: int) -> dict[tuple, list[int]]:
        """``ids`` prefilled once (sparse) and decoded under each cell's budget: forks of the
        prefilled session while exact and within memory, the session itself for the last."""
        from ..memory import available_bytes, need_bytes, shortfall

        first = self._settings(group[0])
        session = Session(self.loaded, first, group[0].base)
        session.new_tokens = new_tokens
        logits, _ = session.prefill(ids)  # the stepped prompt end too: it does not depend on the budget
        outs: dict[tuple, list[int]] = {}
        need = need_bytes(group[0].base, self.loaded.model.config, session.run_settings,
                          len(ids) + new_tokens)
        for c in group[1:]:
            if shortfall(need, available_bytes(first)) is not None:
                break
            try:
                twin = session.fork(self._settings(c))
            except ValueError:
                break
            outs[c.key()] = twin.decode(logits.clone(), new_tokens)[0]
            del twin
        outs[group[0].key()] = session.decode(logits, new_tokens)[0]
        return outs

    def _passkey(self, cell: Cell) -> dict:
        cases = passkey.cases(self.loaded.tokenizer, cell.length, self.n, self.seed, self.depths)
        return self._generated(cell, cases, 8, lambda out, c: passkey.score(out, c.answer))

    def _fidelity(self, cell: Cell) -> dict:
        if cell.length not in self._refs:
            prompts = fidelity_prompts(self.loaded.tokenizer, cell.length, self.n, self.seed)
            self._refs[cell.length] = [
                fidelity.reference(self.loaded, self.settings, p, self.new_tokens) for p in prompts]
        agree = total = 0
        kl = 0.0
        for ref in self._refs[cell.length]:
            f = fidelity.measure(self.loaded, self._settings(cell), cell.base, ref)
            agree, total, kl = agree + f.agree, total + f.total, kl + f.kl_sum
        return {"score": agree / max(1, total), "n": total, "mean_kl": kl / max(1, total)}


def _suite_label(cell: Cell) -> str:
    return cell.method + (f" {cell.budget}" if cell.budget else "") + f" {cell.prompt or 'shipped'}"


def _label(cell: Cell, one_method: bool) -> str:
    """How a progress line names a cell among those computed for one case."""
    if one_method:
        return f" (budget {cell.budget})" if cell.budget else ""
    return f" ({cell.method}" + (f" budget {cell.budget})" if cell.budget else ")")


def _expected(case) -> list[str] | None:
    """What a generated case's answer is scored against (passkey: the key; RULER tasks: the
    needles' values), as text; None for a case without one."""
    want = getattr(case, "expected", None)
    if want is None:
        want = getattr(case, "answer", None)
    if want is None:
        return None
    return [str(w) for w in want] if isinstance(want, (list, tuple)) else [str(want)]
