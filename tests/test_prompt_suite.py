"""The prompt suite: its document generators, scorers and wordings, its cells in ``icecache eval``,
and the shipped qa wording answering a standard passkey document through the CLI."""

from __future__ import annotations

import json

import pytest

from icecache import prompts
from icecache.evals import runner, suite

from .conftest import run_cli


@pytest.mark.parametrize("kind", suite.KINDS)
def test_every_kind_is_deterministic_sized_and_states_its_answers(loaded, kind):
    tok = loaded.tokenizer
    a = suite.cases(kind, tok, 900, 2, seed=1)
    assert [c.document for c in a] == [c.document for c in suite.cases(kind, tok, 900, 2, seed=1)]
    assert a[0].document != suite.cases(kind, tok, 900, 2, seed=2)[0].document
    for c in a:
        tokens = len(tok(c.document)["input_ids"])
        assert 750 <= tokens <= 1000, tokens
        if kind == "report":  # sized by the model's tokenizer: a case at the trained length fits
            assert tokens <= 900, tokens
        assert c.asks and all(x.expected for x in c.asks)
        if c.task == "qa":
            for ask in c.asks:
                assert ask.question.endswith("?")
                assert suite.answered(c.document, ask.expected)  # the document states it
        else:
            assert c.document.rstrip().endswith("left?")
    if a[0].depth is not None:  # the asked fact sits where the case says
        assert [c.depth for c in a] == [0.25, 0.75]
        for c in a:
            at = c.document.find(c.asks[0].expected) / len(c.document)
            assert abs(at - c.depth) < 0.1, (at, c.depth)


def test_a_report_shorter_than_its_facts_still_states_them(loaded):
    """A length the three facts alone exceed: the report is as short as it gets (no endless
    cutting) and still states every fact."""
    doc = suite.make("report", loaded.tokenizer, 30, 0).document
    assert all(sentence in doc for _s, sentence, _q, _a in suite.REPORT_FACTS)
    assert len(loaded.tokenizer(doc)["input_ids"]) < 200


def test_the_passkey_kind_is_the_standard_format(loaded):
    c = suite.cases("passkey_doc", loaded.tokenizer, 600, 1)[0]
    key = c.asks[0].expected
    assert c.document.startswith("There is an important info hidden inside a lot of irrelevant text. Find it "
                                 "and memorize it. I will quiz you about the important information there.")
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in c.document
    assert "The grass is green. The sky is blue." in c.document


def test_a_cot_case_expects_its_arithmetic():
    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": text.split()}

    c = suite.make("cot", Tok(), 200, 0, seed=4)
    nums = [int(x) for x in c.document.split("Problem:")[1].replace(".", " ").split() if x.isdigit()]
    a, b, gone = nums
    assert c.asks[0].expected == str(a * b - gone)
    assert suite.score(c, c.asks[0], f"So {a} * {b} = {a * b}.\nAnswer: {a * b - gone}") == 1.0
    assert suite.score(c, c.asks[0], f"Answer: {a * b}") == 0.0


@pytest.mark.parametrize("output,expected,ok", [
    ("The pass key is 60494.", "60494", True),
    ("The pass key is 60,494.", "60494", True),
    ("The pass key is the pass key.", "60494", False),  # an echo of the question
    ("The pass key is 604945.", "60494", False),  # a number that only contains it
    ("The ferry is called the silver heron.", "Silver Heron", True),
    ("The ferry is called the Silver Star.", "Silver Heron", False),
    ("Ines Duarte sent it.", "Ines Duarte", True),
    ("Ines sent it.", "Ines Duarte", False),
])
def test_answers_are_scored_by_exact_match(output, expected, ok):
    assert suite.answered(output, expected) is ok


def test_wordings_by_name_or_template():
    assert prompts.wording("qa") == prompts.WORDINGS["qa"][prompts.SHIPPED["qa"]]
    assert prompts.wording("qa", "earlier") == "Answer this question about the document above: {question}"
    assert prompts.wording("qa", "Q: {question}") == "Q: {question}"
    with pytest.raises(ValueError, match="neither"):
        prompts.wording("qa", "no slot here")
    text = prompts.qa_messages("The doc.", " Who? ", "earlier")[0]["content"]
    assert text == "Here is a document.\n\nThe doc.\n\nAnswer this question about the document above: Who?"
    assert prompts.cot_messages("2 + 2?", "{problem} Go.")[0]["content"] == "2 + 2? Go."

    per_task, own = suite.parse_wordings(["brief", "earlier", "mine=Q: {question}", "think"])
    assert per_task == {"qa": ["brief", "earlier", "mine"], "cot": ["think"]} and own == {"mine": "Q: {question}"}
    for bad in (["nope"], ["x=no slot"], ["brief=Q: {question}"], ["brief", "brief"], ["=Q: {question}"]):
        with pytest.raises(ValueError):
            suite.parse_wordings(bad)


def test_suite_cells_run_once_per_wording_of_their_task():
    cells = runner.cells(["passkey_doc", "cot", "passkey"], ["full", "ice"], [64], [1000],
                         {"qa": ["brief", "earlier"], "cot": ["think"]})
    got = [(c.task, c.method, c.prompt) for c in cells]
    assert got == [("passkey_doc", "full", "brief"), ("passkey_doc", "full", "earlier"),
                   ("passkey_doc", "ice", "brief"), ("passkey_doc", "ice", "earlier"),
                   ("cot", "full", "think"), ("cot", "ice", "think"),
                   ("passkey", "full", ""), ("passkey", "ice", "")]
    assert len({c.key() for c in cells}) == len(cells)


def test_suite_cells_share_each_cases_prefill_and_score_like_alone(loaded, cpu_settings, monkeypatch):
    """Every wording and method of a case is asked from one prefill of its document (the case's
    own document cache), and each cell's scores are what it gets on its own."""
    from icecache.generation import Session

    prefilled = []
    plain = Session.prefill

    def counted(self, ids, *args, **kwargs):
        logits, stats = plain(self, ids, *args, **kwargs)
        prefilled.append(stats.tokens_prefilled)
        return logits, stats

    monkeypatch.setattr(Session, "prefill", counted)
    cells = [runner.Cell("report", "full", 0, 700, "brief"), runner.Cell("report", "full", 0, 700, "earlier"),
             runner.Cell("report", "ice", 64, 700, "brief")]
    ev = runner.Evaluator(loaded, cpu_settings, 1, 0)
    rows = [ev.run(c, cells[i + 1:]) for i, c in enumerate(cells)]
    assert len(prefilled) == 9  # three questions each
    assert max(prefilled) > 600 and sorted(prefilled)[-2] < 80  # the document once, then each prompt's end
    assert all(row["asked"] == 3 and row["n"] == 1 for row in rows)
    # a cell computed ahead with the group (another method, loading the first one's prefill)
    assert rows[2]["detail"] == runner.Evaluator(loaded, cpu_settings, 1, 0).run(cells[2])["detail"]


def test_eval_prompt_option_errors():
    r = run_cli(["eval", "--tasks", "passkey", "--prompt", "earlier"])
    assert r.returncode == 2 and b"--prompt compares wordings" in r.stderr
    r = run_cli(["eval", "--tasks", "prompts", "--prompt", "nope"])
    assert r.returncode == 2 and b"'nope' is not a wording" in r.stderr


@pytest.mark.parametrize("method", ["full", "ice"])
def test_qa_answers_standard_passkey_documents(loaded, quick_profile, tmp_path, method):
    """The shipped qa wording on passkey documents of about 3k tokens in the paper's format,
    through the CLI (``batch``: one model load): full attention, and ice at budget 64 with its
    pages (dense_until: 0). At least two of three depths answered: the 135M model misses some
    depths under every wording (9/10 at 3.7k, docs/prompts.md), and the broken wording this
    guards against answered none."""
    want = {}
    for i, depth in enumerate((0.2, 0.5, 0.8)):
        case = suite.make("passkey_doc", loaded.tokenizer, 3000, i, seed=7, depth=depth)
        (tmp_path / f"pk{i}.txt").write_text(case.document)
        want[f"pk{i}.txt"] = case.asks[0].expected
    extra = ["--budget", "64", "--profile", quick_profile] if method == "ice" else []
    r = run_cli(["batch", str(tmp_path), "--task", "qa", "-q", "What is the pass key?", "--method", method,
                 "--max-new-tokens", "24", *extra], timeout=900)
    assert r.returncode == 0, r.stderr.decode()[-500:]
    rows = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert len(rows) == 3
    missed = [(row["path"].rsplit("/", 1)[-1], row["output"]) for row in rows
              if not suite.answered(row["output"], want[row["path"].rsplit("/", 1)[-1]])]
    assert len(missed) <= 1, missed


def test_a_cache_that_cannot_roll_back_is_started_afresh(loaded, cpu_settings):
    """The next prompt over the same document reuses a cache by cropping it back to the shared
    prefix; transformers' sliding-window layers refuse once full (Gemma 3 under ``full``): the
    session then starts a new cache instead of failing."""
    from icecache.generation import Session

    class Unrollable:
        is_croppable = True

        def crop(self, n):
            raise RuntimeError("`crop` was called, but the current layer does not track past states")

    s = Session(loaded, cpu_settings, "full")
    s.cache, s.cached_ids = Unrollable(), [1, 2, 3, 4]
    assert s._start([1, 2, 3, 9]) == 0
    assert not isinstance(s.cache, Unrollable) and s.cached_ids == []
