"""The document tasks: summarize, question answering, chain-of-thought.

Each returns a :class:`TaskResult` with the text, token counts and timing; the CLI prints it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import doc_cache, prompts
from .checks import SUMMARY_REPETITION_PENALTY, check_generation_room, check_questions, context_limit
from .config import Settings
from .errors import InputError
from .generation import GenerationStats, Progress, Session
from .memory import check_fits
from .methods import check_method, dense_kv_dtype, dense_plan, get, plan_run
from .models import LoadedModel


@dataclass
class TaskResult:
    task: str
    output: Any  # str, or list[str] for qa (one answer per question)
    model: str
    method: str
    budget: int | None  # None: the method has no budget (full, dense, streaming)
    tokens_in: int
    tokens_out: int
    seconds: float
    answer: str | None = None  # cot only
    questions: list[str] | None = None  # qa only
    stats: list[GenerationStats] = field(default_factory=list)
    memory: dict = field(default_factory=dict)  # peak RSS, resident and host KV bytes

    def to_json(self) -> dict:
        d = {
            "task": self.task,
            "output": self.output,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "model": self.model,
            "method": self.method,
            "budget": self.budget,
            "seconds": round(self.seconds, 3),
        }
        cached = sum(s.prefix_cached_tokens for s in self.stats)
        if cached:
            d["prefix_cached_tokens"] = cached
        if self.memory:
            d["memory"] = self.memory
        if self.task == "cot":
            d["answer"] = self.answer
        if self.task == "qa":
            d["questions"] = self.questions
        return d


class Runner:
    """Runs tasks on one loaded model with one method and settings."""

    def __init__(self, loaded: LoadedModel, settings: Settings, method: str = "full"):
        self.loaded = loaded
        self.settings = settings
        self.method = check_method(method)
        self.session = Session(loaded, settings, method)
        self.warn: Callable[[str], None] | None = None  # where warnings go (the CLI's stderr)
        self.note: Callable[[str], None] | None = None  # where the run's choices are said
        self.budget_flag: int | None = None  # --budget as the user gave it (warned once if unused)
        self._noted = ""  # the last run plan said
        self.session.doc_cache = doc_cache.for_settings(loaded.model, settings, self._warn)

    def _warn(self, message: str) -> None:
        if self.warn:
            self.warn(message)

    @property
    def context_limit(self) -> int:
        """Prompt + generation tokens a run may hold: the model's trained context, or with a
        sparse prefill (whose cost does not grow with the prompt) the profile's ``max_context``."""
        return context_limit(self.settings, self.loaded.context_length, self.method)

    def beyond_trained(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """A warning when a run goes past the positions the model was trained on at their true
        distances (``positions: true``, or a method that cannot remap them)."""
        total = prompt_tokens + max_new_tokens
        plan = plan_run(self.method, self.loaded.model, self.settings, prompt_tokens, max_new_tokens)
        if self.note:
            scaled = f", RoPE {plan.rope_scaling}" if plan.rope_scaling != "none" else ""
            dense = ""
            dense_run, clamp = dense_plan(self.method, self.loaded.model, plan, total, prompt_tokens)
            if dense_run:
                half = dense_kv_dtype(plan, self.loaded.model.device) is not None
                exact = "" if half or clamp is not None else "exact: "
                extra = "; float16 keys, bfloat16 values" if half else ""
                if clamp is not None:
                    extra += f"; distances past {clamp.trained} clamped to {clamp.trained - 1}"
                dense = (f", every layer dense ({exact}the run fits dense_until, {plan.dense_until} tokens"
                         f"{extra})")
            if dense and self.budget_flag is not None:
                self._warn(f"--budget {self.budget_flag} has no effect on this run: its {total} tokens fit "
                           f"dense_until ({plan.dense_until}), so every layer attends to every token "
                           "(a profile with dense_until: 0 selects pages)")
                self.budget_flag = None
            line = (f"{plan.prefill} prefill, {plan.positions} positions{scaled}{dense} ({prompt_tokens} prompt "
                    f"tokens, {self.loaded.context_length} trained)")
            if line != self._noted:  # a document's check and its first question plan the same run
                self.note(line)
                self._noted = line
        if total <= self.loaded.context_length or plan.positions == "remap" or plan.rope_scaling != "none":
            return None
        return (f"{total} tokens go past the {self.loaded.context_length} positions "
                f"{self.loaded.name} was trained on; expect weaker output there")

    def _check_fits(self, ids: list[int], document: str, max_new_tokens: int) -> None:
        limit = self.context_limit
        check_generation_room(max_new_tokens, limit, self.loaded.name)
        if len(ids) + max_new_tokens <= limit:
            warning = self.beyond_trained(len(ids), max_new_tokens)
            if warning and self.warn:
                self.warn(warning)
            check_fits(self.method, self.loaded.model.config, self.settings, len(ids) + max_new_tokens)
            return
        doc_tokens = len(self.loaded.tokenizer(document)["input_ids"])
        raise InputError(
            f"document too long: {doc_tokens} tokens (prompt {len(ids)}) + {max_new_tokens} "
            f"tokens of generation room exceed the limit of {limit} tokens of {self.loaded.name}; "
            "shorten the document or lower --max-new-tokens"
        )

    def _run(self, messages, document, max_new_tokens, on_progress, repetition_penalty, shared: bool = True):
        ids = prompts.render(self.loaded.tokenizer, messages)
        self._check_fits(ids, document, max_new_tokens)
        prefix = 0
        if shared and self.session.doc_cache is not None and len(ids) > self.session.doc_min_tokens:
            prefix = prompts.document_prefix(self.loaded.tokenizer, document)
        tokens, stats = self.session.generate(ids, max_new_tokens, on_progress, repetition_penalty, prefix=prefix)
        if stats.prefix_cached_tokens and self.note:
            self.note(f"document cache: {stats.prefix_cached_tokens} prompt tokens loaded, "
                      f"{stats.tokens_prefilled} prefilled")
        text = self.loaded.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        return text, stats

    def prefill_document(self, document: str, on_progress: Progress | None = None) -> GenerationStats:
        """Prefill ``document`` into the document cache without generating (``icecache
        prefill``): the prompt a summary would have, up to where every prompt over the document
        agrees. Stats say whether it was loaded (already saved) instead."""
        ids = prompts.render(self.loaded.tokenizer, prompts.summarize_messages(document))
        self._check_fits(ids, document, 1)
        prefix = prompts.document_prefix(self.loaded.tokenizer, document) if self.session.doc_cache else 0
        self.session.new_tokens = 1
        _, stats = self.session.prefill(ids, on_progress, hold_tail=True, prefix=prefix)
        self.session._pending = None  # the prompt's end is not needed
        return stats

    def _result(self, task: str, output: Any, stats: list[GenerationStats], t0: float, **kw) -> TaskResult:
        return TaskResult(
            task=task,
            output=output,
            model=self.loaded.name,
            method=self.method,
            budget=self.settings.budget if get(self.method).budgeted else None,
            tokens_in=sum(s.tokens_in for s in stats),
            tokens_out=sum(s.tokens_out for s in stats),
            seconds=time.perf_counter() - t0,
            stats=stats,
            **kw,
        )

    def summarize(self, document: str, max_new_tokens: int = 256, on_progress: Progress | None = None,
                  repetition_penalty: float = SUMMARY_REPETITION_PENALTY) -> TaskResult:
        t0 = time.perf_counter()
        messages = prompts.summarize_messages(document)
        text, stats = self._run(messages, document, max_new_tokens, on_progress, repetition_penalty)
        return self._result("summarize", text, [stats], t0)

    def qa(self, document: str, questions: list[str], max_new_tokens: int = 64, on_progress: Progress | None = None,
           repetition_penalty: float = 1.0, wording: str | None = None) -> TaskResult:
        """Each question answered from ``document``; ``wording``: a qa wording other than the
        shipped one (:func:`icecache.prompts.wording`)."""
        check_questions(questions)
        t0 = time.perf_counter()
        # Check every prompt before generating anything: no partial answers for a bad input.
        for q in questions:
            ids = prompts.render(self.loaded.tokenizer, prompts.qa_messages(document, q, wording))
            self._check_fits(ids, document, max_new_tokens)
        answers, all_stats = [], []
        for q in questions:
            messages = prompts.qa_messages(document, q, wording)
            text, stats = self._run(messages, document, max_new_tokens, on_progress, repetition_penalty)
            answers.append(text)
            all_stats.append(stats)
        return self._result("qa", answers, all_stats, t0, questions=list(questions))

    def cot(self, problem: str, max_new_tokens: int = 512, on_progress: Progress | None = None,
            repetition_penalty: float = 1.0, wording: str | None = None) -> TaskResult:
        t0 = time.perf_counter()
        messages = prompts.cot_messages(problem, wording)
        text, stats = self._run(messages, problem, max_new_tokens, on_progress, repetition_penalty, shared=False)
        return self._result("cot", text, [stats], t0, answer=prompts.extract_answer(text))
