"""Evaluation pieces: passkey generation and scoring, fidelity, cells and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from icecache.errors import UsageError
from icecache.evals import fidelity, passkey, records, runner

from .conftest import run_cli


def test_passkey_cases_deterministic_and_placed(loaded):
    tok = loaded.tokenizer
    a = passkey.cases(tok, 600, 3, seed=2)
    b = passkey.cases(tok, 600, 3, seed=2)
    assert [c.prompt for c in a] == [c.prompt for c in b]
    assert [c.answer for c in a] != [c.answer for c in passkey.cases(tok, 600, 3, seed=3)]
    for c in a:
        assert c.prompt.count(c.answer) == 2 and c.prompt.endswith(passkey.QUESTION)
        assert 450 <= c.tokens <= 650
    # depth 0 puts the needle first, depth 1 last
    first, last = a[0], a[-1]
    assert first.prompt.index(first.answer) < len(first.prompt) * 0.2
    assert last.prompt.index(last.answer) > len(last.prompt) * 0.8


def test_passkey_score():
    assert passkey.score(" 12345. Remember", "12345") == 1.0
    assert passkey.score(" 1234", "12345") == 0.0
    assert passkey.score(" the key is 99 and 12345", "12345") == 0.0  # the first number counts
    assert passkey.score(" no number", "12345") == 0.0


def test_fidelity_of_full_to_itself_and_of_a_tiny_budget(loaded, cpu_settings):
    ids = runner.fidelity_prompts(loaded.tokenizer, 400, 1, seed=0)[0]
    assert 250 <= len(ids) <= 400
    ref = fidelity.reference(loaded, cpu_settings, ids, 12, force_past_end=True)
    assert len(ref.tokens) == 12
    same = fidelity.measure(loaded, cpu_settings, "full", ref)
    assert same.agreement == 1.0 and abs(same.mean_kl) < 1e-4
    tiny = cpu_settings.replace(budget=16, sink_pages=1, window_pages=1)
    worse = fidelity.measure(loaded, tiny, "streaming", ref)
    assert worse.total == 12 and worse.mean_kl > same.mean_kl
    # a run with positions remapped (for the paged methods it measures) still has full's
    # reference, at true positions: the same tokens
    remapped = fidelity.reference(loaded, cpu_settings.replace(positions="remap"), ids, 12, force_past_end=True)
    assert remapped.tokens == ref.tokens


def test_cells_and_resume(tmp_path):
    cells = runner.cells(["passkey"], ["full", "ice", "streaming"], [64, 256], [1000])
    assert [(c.method, c.budget) for c in cells] == [("full", 0), ("ice", 64), ("ice", 256), ("streaming", 0)]
    records.append(tmp_path, {"task": "passkey", "method": "full", "budget": 0, "length": 1000, "score": 1.0, "n": 1})
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"task": "passkey", "meth')  # a line cut by a kill
    done = records.load_done(tmp_path)
    assert list(done) == [("passkey", "full", 0, 1000, "")]  # (a row without a wording: the shipped one's)
    assert list(done) == [cells[0].key()]


def test_eval_command_json_and_resume(tmp_path):
    png = tmp_path / "picture.png"
    args = ["eval", "--tasks", "passkey", "--methods", "full,ice", "--budgets", "64", "--lengths", "400",
            "--n", "2", "--out", str(tmp_path), "--json", "--depths", "10,90", "--plot", str(png)]
    r = run_cli(args)
    assert r.returncode == 0, r.stderr.decode()
    rows = json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]
    saved = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert all(x["depths"] == [0.1, 0.9] for x in saved)
    # the picture: one grid per method, a row per depth, in the terminal and as a PNG
    err = r.stderr.decode()
    assert "passkey · full" in err and "passkey · ice @ 64" in err and "10%" in err and "90%" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {(x["method"], x["budget"]) for x in rows} == {("full", 0), ("ice", 64)}
    assert all(x["n"] == 2 and 0 <= x["score"] <= 1 for x in rows)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["n"] == 2
    assert config["settings"]["dense_until"] == 0  # ice's pages measured on short documents too (cpu profile: 8192)
    again = run_cli(args)  # everything already there: nothing recomputed
    assert again.returncode == 0 and "[1/2]" not in again.stderr.decode()
    assert json.loads(again.stdout.decode().strip().splitlines()[-1])["results"] == rows
    other_n = run_cli([a if a != "2" else "3" for a in args])  # other cases: refused, kept
    assert other_n.returncode == 2 and "n 2, not 3" in other_n.stderr.decode()
    assert json.loads((tmp_path / "config.json").read_text())["n"] == 2
    bad = run_cli(["eval", "--tasks", "ruler", "--n", "1"])
    assert bad.returncode == 2 and "unknown task 'ruler'" in bad.stderr.decode()
    for depths, why in (("0:95", "not a list of percents"), ("0,120", "from 0 to 100")):
        bad = run_cli(["eval", "--depths", depths, "--n", "1"])
        assert bad.returncode == 2 and why in bad.stderr.decode()


def test_a_killed_eval_resumes_mid_cell_from_its_finished_cases(loaded, cpu_settings, tmp_path):
    """Each case's score is written as it is made (cases.jsonl); a new run into the same --out
    takes the finished cases of an unfinished cell and computes only the others."""
    cell = runner.Cell("passkey", "full", 0, 400)
    logs = []
    first = runner.Evaluator(loaded, cpu_settings, 3, 0, out=tmp_path, log=logs.append).run(cell)
    lines = [json.loads(x) for x in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert [(x["cell"], x["case"], x["score"]) for x in lines] == [
        (list(cell.key()), i, s) for i, s in enumerate(first["detail"])]
    # each line also keeps the start of the answer and what it was scored against
    cases = passkey.cases(loaded.tokenizer, 400, 3, 0)
    for x, case in zip(lines, cases, strict=True):
        assert x["expected"] == [case.answer]
        assert isinstance(x["output"], str) and len(x["output"]) <= records.OUTPUT_CHARS
        assert x["score"] == passkey.score(x["output"], case.answer)
    # a run killed after two cases (its second case's line cut short), with a planted score
    # that no real case gives, so that reuse shows
    (tmp_path / "cases.jsonl").write_text(
        json.dumps({"cell": list(cell.key()), "case": 0, "score": 0.25}) + "\n"
        + '{"cell": ["passkey", "full", 0, 400], "case": 1, "sc')
    logs.clear()
    again = runner.Evaluator(loaded, cpu_settings, 3, 0, out=tmp_path, log=logs.append).run(cell)
    assert again["detail"] == [0.25, *first["detail"][1:]]
    assert "(from" in logs[0] and all("(from" not in x for x in logs[1:]) and len(logs) == 3


def test_cells_of_one_task_and_length_run_case_by_case(loaded, cpu_settings, monkeypatch):
    """The pending cells of a task and length (other methods, other budgets) are computed case by
    case with the first: one shared prefill per case, dropped before the next (an eval's memory
    does not grow with its cases), and every cell's scores as it gets on its own."""
    import gc

    from icecache.generation import Prefilled

    cells = [runner.Cell("passkey", "full", 0, 400), runner.Cell("passkey", "ice", 32, 400),
             runner.Cell("passkey", "ice", 64, 400)]
    made, held = [], []
    plain = runner.prefill_once

    def counted(*args, **kwargs):
        held.append(sum(type(o) is Prefilled for o in gc.get_objects()))  # before this case's
        made.append(plain(*args, **kwargs))
        return made.pop()  # the runner's reference only

    monkeypatch.setattr(runner, "prefill_once", counted)
    logs = []
    ev = runner.Evaluator(loaded, cpu_settings, 3, 0, log=logs.append)
    rows = [ev.run(c, cells[i + 1 :]) for i, c in enumerate(cells)]
    assert len(held) == 3  # one prefill per case, for the three cells
    assert held[1:] == held[:1] * 2  # none kept from the case before
    assert len(logs) == 3 and all(x.count("(") == 3 for x in logs)  # each line scores the three cells
    monkeypatch.setattr(runner, "prefill_once", plain)
    for c, row in zip(cells, rows, strict=True):
        alone = runner.Evaluator(loaded, cpu_settings, 3, 0).run(c)
        assert row["detail"] == alone["detail"] and row["n"] == 3


def test_a_resumed_sparse_group_keeps_every_budgets_new_cases(loaded, cpu_settings, tmp_path):
    """Sibling budgets decode from one sparse prefill per case. After an interrupted run in which
    one budget has a case the other lacks, a case computed for both is kept for both (it was
    dropped for the budget missing the earlier case, whose own run then prefilled it again)."""
    settings = cpu_settings.replace(prefill="sparse", chunk_size=256, prefill_budget=256, dense_window=256)
    a, b = runner.Cell("passkey", "ice", 32, 500), runner.Cell("passkey", "ice", 64, 500)
    (tmp_path / "cases.jsonl").write_text(json.dumps({"cell": list(a.key()), "case": 0, "score": 0.25}) + "\n")
    got_a = runner.Evaluator(loaded, settings, 2, 0, out=tmp_path).run(a, [b])
    assert got_a["detail"][0] == 0.25 and got_a["n"] == 2
    lines = [json.loads(x) for x in (tmp_path / "cases.jsonl").read_text().splitlines()]
    made = {(tuple(x["cell"]), x["case"]): x["score"] for x in lines}
    assert set(made) == {(a.key(), 0), (a.key(), 1), (b.key(), 1)}
    logs = []
    got_b = runner.Evaluator(loaded, settings, 2, 0, out=tmp_path, log=logs.append).run(b)
    assert "(from" not in logs[0] and "(from" in logs[1]  # only case 0 computed
    assert got_b["detail"][1] == made[b.key(), 1]


def test_eval_plot_without_matplotlib(tmp_path):
    """Without the plot extra, --plot is one clear error before any work."""
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed')\n")
    r = run_cli(["eval", "--n", "1", "--lengths", "300", "--plot", str(tmp_path / "p.png")],
                env={"PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 2
    assert "--plot needs matplotlib: pip install 'icecache[plot]'" in r.stderr.decode()
    assert not (tmp_path / "p.png").exists()


def test_depth_spread_and_parse():
    sweep = passkey.parse_depths("0:95:5")
    assert len(sweep) == 20 and sweep[0] == 0 and sweep[-1] == 0.95
    assert passkey.parse_depths("50, 0,100,50") == [0, 0.5, 1.0]
    assert passkey.spread(20, sweep) == sweep  # every depth once
    assert passkey.spread(40, sweep) == sweep + sweep
    assert passkey.spread(3, sweep) == [0, 0.5, 0.95]  # both ends and the middle
    assert passkey.spread(1, sweep) == [0]
    assert passkey.spread(3) == [0, 0.5, 1.0]  # no list: evenly over 0..1
    for bad in ("", "a,b", "0:95:0", "-5,10", "0:95"):
        with pytest.raises(ValueError):
            passkey.parse_depths(bad)


def test_depth_grids():
    from icecache.evals.grid import depth_grids

    rows = [
        {"task": "passkey", "method": "ice", "budget": 64, "length": 2048, "detail": [1, 0, 1],
         "depths": [0.0, 0.5, 0.0]},
        {"task": "passkey", "method": "ice", "budget": 64, "length": 1024, "detail": [1.0, 1.0],
         "depths": [0.0, 0.95]},
        {"task": "passkey", "method": "full", "budget": 0, "length": 1024, "detail": [0.0],
         "depths": [0.5]},
        {"task": "vt", "method": "ice", "budget": 64, "length": 1024, "detail": [1.0]},  # no depths
    ]
    grids = {(g.method, g.budget): g for g in depth_grids(rows)}
    assert set(grids) == {("ice", 64), ("full", 0)}
    g = grids["ice", 64]
    assert g.lengths == [1024, 2048] and g.depths == [0.0, 0.5, 0.95]
    assert g.cells == [[1.0, 1.0], [None, 0.0], [1.0, None]]
    assert g.counts == [[1, 2], [0, 1], [1, 0]]
    assert g.overall == pytest.approx(4 / 5)
    assert grids["full", 0].cells == [[0.0]] and grids["full", 0].title == "passkey · full"


def test_check_resumable(tmp_path):
    cfg = {"tasks": ["passkey"], "n": 10, "seed": 0, "new_tokens": 160, "data": None,
           "model": "embedded", "settings": {"budget": 256, "index_beam": 32}}
    records.check_resumable(tmp_path, cfg)  # empty folder: fine
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    records.append(tmp_path, {"task": "passkey", "method": "full", "budget": 0, "length": 1000,
                              "score": 1.0, "n": 10})
    records.check_resumable(tmp_path, cfg | {"tasks": ["passkey", "vt"]})  # more cells: fine
    records.check_resumable(tmp_path, cfg | {"settings": {"budget": 64, "index_beam": 32}})
    # a setting added by a later version: absent from the old file, not compared
    records.check_resumable(tmp_path, cfg | {"settings": {"budget": 256, "index_beam": 32,
                                                          "prefill": "full"}})
    with pytest.raises(UsageError, match="seed 0, not 1"):
        records.check_resumable(tmp_path, cfg | {"seed": 1})
    with pytest.raises(UsageError, match="other settings \\(index_beam\\)"):
        records.check_resumable(tmp_path, cfg | {"settings": {"budget": 256, "index_beam": 8}})


def test_ruler_tasks_deterministic_and_answerable(loaded):
    from icecache.evals import ruler

    tok = loaded.tokenizer
    for task in ruler.TASKS:
        a = ruler.cases(task, tok, 500, 2, seed=1)
        assert [c.prompt for c in a] == [c.prompt for c in ruler.cases(task, tok, 500, 2, seed=1)]
        assert [c.prompt for c in a] != [c.prompt for c in ruler.cases(task, tok, 500, 2, seed=2)]
        for c in a:
            assert 350 <= c.tokens <= 650, (task, c.tokens)
            body = c.prompt.rsplit("\n", 1)[0]  # the answer is in the text, not in the question
            assert all(e in body for e in c.expected)
            assert ruler.score(" " + ", ".join(c.expected), c.expected) == 1.0
            assert ruler.score(" nothing here", c.expected) == 0.0
    case = ruler.cases("fwe", tok, 500, 1, seed=0)[0]
    words = case.prompt.split("\n")[0].split()
    counts = sorted(((words.count(w), w) for w in set(words) if w.islower() and w.isalpha()), reverse=True)
    assert {w for _, w in counts[:3]} == set(case.expected)
    assert ruler.score(f" {case.expected[0]} and more", case.expected) == 1 / 3
    # niah_prose: the needle between two sentences of the prose, at the case's depth
    for c in ruler.cases("niah_prose", tok, 1500, 5, seed=3):
        body = c.prompt.rsplit("\n", 1)[0]
        at = body.index("One of the special magic numbers")
        assert abs(at / len(body) - c.depth) < 0.08, (c.depth, at / len(body))
        assert at == 0 or body[at - 2 : at] in (". ", ": ") or body[at - 1] == "\n"
        assert len(set(w for w in body.split() if w.isdigit())) > 10  # numbers all over the haystack


GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_test.jsonl"


def test_gsm8k_answers_and_prediction():
    from icecache.evals import gsm8k

    assert gsm8k.gold("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18") == "18"
    assert gsm8k.gold("so\n#### 1,250") == "1250"
    assert gsm8k.predict(" 3 + 4 = 7 apples.\n#### 7\n\nQuestion: next one 99") == "7"
    assert gsm8k.predict(" She pays 12.50 dollars, then 30.") == "30"
    assert gsm8k.predict(" no idea") == ""
    assert gsm8k.score(" so #### 42", "42") == 1.0 and gsm8k.score(" #### 41", "42") == 0.0


def test_gsm8k_load_errors(tmp_path):
    from icecache.errors import InputError
    from icecache.evals import gsm8k

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(InputError, match="line 1"):
        gsm8k.load(bad)
    with pytest.raises(InputError, match="no such file"):
        gsm8k.load(tmp_path / "missing.jsonl")


@pytest.mark.skipif(not GSM8K.exists(), reason="the shared GSM8K file is not on this machine")
def test_gsm8k_cases_from_the_shared_file(loaded):
    from icecache.evals import gsm8k

    rows = gsm8k.load(GSM8K)
    cs = gsm8k.cases(rows, loaded.tokenizer, 1500, 3, seed=0)
    assert [c.prompt for c in cs] == [c.prompt for c in gsm8k.cases(rows, loaded.tokenizer, 1500, 3, seed=0)]
    for c in cs:
        assert 1200 <= c.tokens <= 1500 and c.prompt.endswith("\nAnswer:") and c.answer
        assert c.prompt.count("Question:") >= 3 and "<<" not in c.prompt


def test_longbench_scorers_and_loading(tmp_path):
    from icecache.errors import InputError
    from icecache.evals import longbench

    assert longbench.normalize("The  Cat, sat!") == "cat sat"
    assert longbench.qa_f1("The cat sat.", ["cat sat"]) == 1.0
    assert longbench.qa_f1("a dog", ["cat sat"]) == 0.0
    assert abs(longbench.qa_f1("cat on mat", ["cat sat on the mat"]) - 2 * (1.0 * 0.75) / 1.75) < 1e-9
    assert longbench.qa_f1("x", ["cat", "x"]) == 1.0  # best over answers
    assert longbench.rouge_l("the cat sat on the mat", ["the cat sat on the mat"]) == 1.0
    assert 0 < longbench.rouge_l("the cat is on the mat", ["the cat sat on the mat"]) < 1
    f = tmp_path / "lb.jsonl"
    f.write_text('{"context": "c", "question": "q", "answers": "a"}\n\n')
    assert longbench.load(f) == [{"context": "c", "question": "q", "answers": ["a"]}]
    f.write_text('{"context": "c"}\n')
    with pytest.raises(InputError, match="line 1"):
        longbench.load(f)


@pytest.mark.parametrize("method", ["full", "dense", "ice", "quest", "snapkv", "streaming", "oracle",
                                    "arkvale", "h2o", "omnikv", "pqcache", "magicpig"])
def test_shared_prefill_decodes_like_own_prefill(loaded, cpu_settings, method):
    """A session seeded from the one shared prefill decodes as if it had prefilled itself."""
    from icecache.generation import Session, prefill_once

    settings = cpu_settings.replace(budget=32)
    case = passkey.cases(loaded.tokenizer, 420, 1, seed=4)[0]
    ids = loaded.tokenizer(case.prompt)["input_ids"]
    own, _ = Session(loaded, settings, method).generate(ids, 12)
    pre = prefill_once(loaded, settings, ids)
    assert len(pre.obs_queries) == loaded.model.config.num_hidden_layers
    shared, stats = Session(loaded, settings, method).generate_from(pre, 12)
    assert shared == own and stats.tokens_in == len(ids)


def test_cells_of_a_method_variant_follow_its_method():
    cells = runner.cells(["passkey"], ["full", "ice[answer_spans=1]", "streaming[window_pages=4]"], [64, 256], [400])
    assert [(c.method, c.budget) for c in cells] == [
        ("full", 0), ("ice[answer_spans=1]", 64), ("ice[answer_spans=1]", 256), ("streaming[window_pages=4]", 0)]


def test_a_variant_cell_runs_its_method_with_its_own_settings(loaded, cpu_settings, monkeypatch):
    """'ice[window_pages=1]' decodes as ice with one window page at the cell's budget; plain
    'ice' in the same evaluator keeps the profile's window."""
    seen = []
    real = runner.Session

    class Recording(real):
        def __init__(self, loaded_, settings, method, *a, **k):
            seen.append((method, settings.window_pages, settings.budget))
            super().__init__(loaded_, settings, method, *a, **k)

    monkeypatch.setattr(runner, "Session", Recording)
    variant = cpu_settings.replace(window_pages=1)
    ev = runner.Evaluator(loaded, cpu_settings, 1, 0, variants={"ice[window_pages=1]": variant})
    a = ev.run(runner.Cell("passkey", "ice[window_pages=1]", 64, 400))
    b = ev.run(runner.Cell("passkey", "ice", 64, 400))
    assert a["n"] == b["n"] == 1
    assert seen == [("ice", 1, 64), ("ice", cpu_settings.window_pages, 64)]


def test_eval_method_variants_on_the_command_line(tmp_path):
    for methods, why in (("ice[weights=int8]", "weights is the same for every method of a run"),
                         ("ice[budget=64]", "budget is the same for every method"),
                         ("ice,ice", "'ice' is named twice")):  # more bad variants: test_decode_bench
        bad = run_cli(["eval", "--methods", methods, "--n", "1"])
        assert bad.returncode == 2, (methods, bad.stderr.decode())
        assert why in bad.stderr.decode() and "Traceback" not in bad.stderr.decode(), methods
    r = run_cli(["eval", "--tasks", "passkey", "--methods", "ice,ice[window_pages=1,answer_spans=1]",
                 "--budgets", "64", "--lengths", "400", "--n", "1", "--json", "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr.decode()
    rows = json.loads(r.stdout.decode().strip().splitlines()[-1])["results"]
    assert [(x["method"], x["budget"], x["n"]) for x in rows] == [
        ("ice", 64, 1), ("ice[window_pages=1,answer_spans=1]", 64, 1)]
    assert json.loads((tmp_path / "config.json").read_text())["methods"] == [
        "ice", "ice[window_pages=1,answer_spans=1]"]


def test_variant_labels_are_printed_as_written(monkeypatch):
    """A method variant's label ('ice[window_pages=8]') has brackets that rich would read as
    markup and drop: the eval table, the depth pictures and the bench table print it whole."""
    from rich.console import Console

    import icecache_cli.bench as bench_cli
    import icecache_cli.evaluate as evaluate_cli
    import icecache_cli.picture as picture
    from icecache.bench.full_bench import BenchRow
    from icecache.evals.grid import depth_grids

    label = "ice[window_pages=8,answer_spans=3]"
    out = Console(record=True, width=200, color_system=None)
    for mod in (evaluate_cli, picture, bench_cli):
        monkeypatch.setattr(mod, "stderr", out)
    rows = [{"task": "passkey", "method": label, "budget": 64, "length": 1024, "n": 1, "score": 1.0,
             "detail": [1.0], "depths": [0.5]}]
    evaluate_cli.print_table(rows)
    picture.print_grids(depth_grids(rows))
    bench_cli.print_bench_table([BenchRow(label, 1024, tpot_ms=50.0),
                                 BenchRow(label, 1024, status="skipped", reason="x")], 1024)
    text = out.export_text()
    # the eval row, the picture's title, two bench rows, the KV source note, the skipped note
    assert text.count(label) == 6, text
