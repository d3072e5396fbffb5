"""``icecache eval``: task x method x budget x length cells, scored relative to ``full``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from icecache.config import resolve_settings
from icecache.errors import UsageError
from icecache.prompts import WORDINGS
from icecache.variants import RUN_KEYS, parse_methods

from .bench import parse_size
from .output import Reporter, emit, stderr, user_errors

WORDING_NAMES = "; ".join(f"{task}: {', '.join(names)}" for task, names in WORDINGS.items())


def evaluate(
    tasks: Annotated[str, typer.Option("--tasks", help="Tasks, comma-separated: passkey, niah_single, niah_multikey, niah_multivalue, niah_prose, vt, fwe, gsm8k, longbench, fidelity; the prompt suite's kinds (passkey_doc, code_prose, locker_list, fact_prose, report, log, table, memo, cot), or 'prompts' for all of them.")] = "passkey",
    prompt: Annotated[list[str] | None, typer.Option("--prompt", metavar="WORDING", help=f"The prompt suite: a qa or cot wording to compare (repeat): a name ({WORDING_NAMES}) or LABEL=TEMPLATE with {{question}} or {{problem}}. Default: the shipped wordings.", show_default=False)] = None,
    methods: Annotated[str, typer.Option("--methods", help="Methods, comma-separated (full is the reference). A method may change profile keys for its own cells: 'ice\\[answer_spans=3,window_pages=8]' (not the budget, which --budgets gives, nor the model's keys).")] = "full,ice",
    budgets: Annotated[str, typer.Option("--budgets", help="Budgets in tokens, comma-separated.")] = "64,128,256",
    lengths: Annotated[str, typer.Option("--lengths", help="Prompt lengths in tokens (2k = 2048).")] = "2k",
    n: Annotated[int, typer.Option("--n", min=1, help="Cases (passkey: depths; fidelity: documents) per cell.")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the generated cases.")] = 0,
    depths: Annotated[str, typer.Option("--depths", help="passkey, niah_single, niah_prose: needle depths in percent, a list (0,50,100) or a range FROM:TO:STEP; spread over the --n cases of a cell.")] = "0:95:5",
    plot: Annotated[Path | None, typer.Option("--plot", help="Also draw the length x depth picture of the needle tasks as a PNG (needs the plot extra: matplotlib).", show_default=False)] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1, help="fidelity: tokens full generates per document.")] = 160,
    data: Annotated[str | None, typer.Option("--data", help="gsm8k: JSONL of GSM8K problems (question, answer with '#### N'); longbench: JSONL of context, question, answers.", show_default=False)] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Folder for results.jsonl and config.json; a rerun resumes.", show_default=False)] = None,
    prefill: Annotated[str | None, typer.Option("--prefill", help="full (one shared prefill per case) or sparse (each method's own sparse prefill; ice, ice-reuse, streaming, quest). Default: the profile's.", show_default=False)] = None,
    positions: Annotated[str | None, typer.Option("--positions", help="RoPE positions past the trained context: remap, true or auto. Default: the profile's.", show_default=False)] = None,
    rope_scaling: Annotated[str | None, typer.Option("--rope-scaling", help="RoPE scaling past the trained context: none, linear, dynamic or yarn (e.g. for full). Default: the profile's.", show_default=False)] = None,
    chunk_size: Annotated[int | None, typer.Option("--chunk-size", min=1, help="Prompt tokens per prefill chunk. Default: the profile's.", show_default=False)] = None,
    weights: Annotated[str | None, typer.Option("--weights", help="The linear layers' weights: float, int8, int4 (CPU) or auto. Default: the profile's.", show_default=False)] = None,
    profile: Annotated[str | None, typer.Option("--profile", "-p", help="Hardware profile.", show_default=False)] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (default: embedded).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document as the last stdout line.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="Nothing on stderr but errors.")] = False,
) -> None:
    """Score methods on locally generated tasks (no downloads)."""
    from icecache.evals import records, runner
    from icecache.methods import check_prefill
    from icecache.models import load_model

    with user_errors(), Reporter(quiet) as rep:
        task_list = []
        for t in (t.strip() for t in tasks.split(",") if t.strip()):
            if t not in runner.TASKS and t not in runner.GROUPS:
                raise UsageError(f"--tasks: unknown task '{t}' (known: {', '.join(runner.TASKS)}, "
                                 f"{', '.join(runner.GROUPS)})")
            task_list += [x for x in runner.GROUPS.get(t, (t,)) if x not in task_list]
        from icecache.evals import suite

        try:
            wording_names, own_wordings = suite.parse_wordings(prompt or [])
        except ValueError as exc:
            raise UsageError(f"--prompt: {exc}") from None
        if prompt and not any(t in suite.KINDS for t in task_list):
            raise UsageError("--prompt compares wordings on the prompt suite's kinds: add them to --tasks (e.g. prompts)")
        # eval measures the methods at their budgets: ice keeps its sparse layers on short
        # documents too, unless a variant says otherwise ('ice[dense_until=8192]')
        settings = resolve_settings(profile, prefill=prefill, chunk_size=chunk_size, positions=positions,
                                    rope_scaling=rope_scaling, weights=weights).replace(dense_until=0)
        method_list, variants = [], {}
        for label, method, method_settings in parse_methods(methods, settings, fixed=(*RUN_KEYS, "budget")):
            check_prefill(method, method_settings)
            method_list.append(label)
            if method_settings is not settings:
                variants[label] = method_settings
        budget_list = []
        for b in budgets.split(","):
            if not b.strip():
                continue
            if not b.strip().isdigit() or int(b) <= 0 or int(b) % settings.page_size:
                raise UsageError(f"--budgets: '{b}' is not a positive multiple of {settings.page_size}")
            budget_list.append(int(b))
        length_list = [parse_size(s) for s in lengths.split(",") if s.strip()]
        needs_data = [t for t in task_list if t in runner.DATA_TASKS]
        if len(needs_data) > 1:
            raise UsageError(f"--tasks: {' and '.join(needs_data)} each read --data; run them separately")
        if needs_data:
            from icecache.evals import gsm8k, longbench

            if data is None:
                raise UsageError(f"--tasks {needs_data[0]} needs --data PATH (a JSONL file)")
            (gsm8k if needs_data[0] == "gsm8k" else longbench).load(data)  # fail now, not after hours
        from icecache.evals.passkey import parse_depths

        try:
            depth_list = parse_depths(depths)
        except ValueError as exc:
            raise UsageError(f"--depths: {exc}") from None
        if plot is not None:
            from .picture import check_plot_available

            check_plot_available()
            if not (plot.parent if str(plot.parent) else Path(".")).is_dir():
                raise UsageError(f"--plot: folder {plot.parent} does not exist")
        if out is not None and out.exists() and not out.is_dir():
            raise UsageError(f"--out: {out} exists and is not a folder")
        all_cells = runner.cells(task_list, method_list, budget_list, length_list, wording_names)
        config = {"tasks": task_list, "methods": method_list, "budgets": budget_list,
                  "lengths": length_list, "n": n, "seed": seed, "new_tokens": new_tokens,
                  "data": data, "settings": settings.as_dict(), "model": model or "embedded",
                  "depths": depth_list, "wordings": own_wordings}
        if out is not None:
            records.check_resumable(out, config)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(config, indent=1))
        done = records.load_done(out)
        loaded = load_model(model, settings, log=rep.info)
        ev = runner.Evaluator(loaded, settings, n, seed, new_tokens, log=rep.info, data=data,
                              depths=depth_list, out=out, variants=variants, wordings=own_wordings)
        rows = []
        for i, cell in enumerate(all_cells):
            if cell.key() in done:
                rows.append(done[cell.key()])
                continue
            rep.info(f"[{i + 1}/{len(all_cells)}] {cell.task} {cell.method} budget {cell.budget or '-'} length {cell.length}"
                     + (f" wording {cell.prompt}" if cell.prompt else ""))
            result = ev.run(cell, [c for c in all_cells[i + 1:] if c.key() not in done])
            row = {"task": cell.task, "method": cell.method, "budget": cell.budget,
                   "length": cell.length, **({"prompt": cell.prompt} if cell.prompt else {}), **result}
            records.append(out, row)
            rows.append(row)
            rep.progress("cells", i + 1, len(all_cells))
        rep.close()
        from icecache.evals.grid import depth_grids

        from .picture import print_grids, write_plot

        grids = depth_grids(rows)
        if not quiet:
            print_table(rows)
            print_grids(grids)
        if plot is not None:
            write_plot(grids, plot)
            if not quiet:
                stderr.print(f"picture written to {plot}", soft_wrap=True)
        if as_json:
            emit(json.dumps({"results": [
                {k: r[k] for k in ("task", "method", "budget", "length", "prompt", "n", "score") if k in r}
                | ({"mean_kl": r["mean_kl"]} if "mean_kl" in r else {}) for r in rows]}))


def print_table(rows: list[dict]) -> None:
    full = {(r["task"], r["length"], r.get("prompt", "")): r["score"] for r in rows if r["method"] == "full"}
    worded = any(r.get("prompt") for r in rows)
    t = Table(title="icecache eval", box=None)
    for c in ("task", "length", "method", "budget", *(("wording",) if worded else ()), "n", "score", "% of full", "mean KL"):
        t.add_column(c)
    for r in rows:
        ref = full.get((r["task"], r["length"], r.get("prompt", "")))
        pct = f"{100 * r['score'] / ref:.1f}" if ref else "-"
        t.add_row(r["task"], str(r["length"]), escape(r["method"]), str(r["budget"] or "-"),
                  *((escape(r.get("prompt") or "shipped"),) if worded else ()), str(r["n"]),
                  f"{r['score']:.3f}", pct, f"{r['mean_kl']:.4f}" if "mean_kl" in r else "")
    stderr.print(t)
    print_wordings(rows)


def print_wordings(rows: list[dict]) -> None:
    """The prompt suite's rows as one Markdown table per (length, method, budget) on stderr: a
    line per wording, its answers found of those asked for each kind, and its worst kind's
    share among the kinds where some wording answers at least half (a kind that every wording
    fails tells none apart)."""
    from icecache.evals import suite

    mine = [r for r in rows if r["task"] in suite.KINDS and "asked" in r]
    for length, method, budget in dict.fromkeys((r["length"], r["method"], r["budget"]) for r in mine):
        part = [r for r in mine if (r["length"], r["method"], r["budget"]) == (length, method, budget)]
        kinds = list(dict.fromkeys(r["task"] for r in part))
        telling = {r["task"] for r in part if r["score"] >= 0.5}
        lines = [f"prompt suite, {length} tokens, {method}" + (f" @ {budget}" if budget else ""),
                 "| wording | " + " | ".join(kinds) + " | worst |", "|---" * (len(kinds) + 2) + "|"]
        for w in dict.fromkeys(r.get("prompt", "") for r in part):
            got = {r["task"]: r for r in part if r.get("prompt", "") == w}
            cells = [f"{round(got[k]['score'] * got[k]['asked'])}/{got[k]['asked']}" if k in got else "" for k in kinds]
            worst = min((got[k]["score"] for k in got if k in telling), default=0.0)
            lines.append(f"| {w or 'shipped'} | " + " | ".join(cells) + f" | {worst:.2f} |")
        stderr.print(escape("\n".join(lines)), soft_wrap=True, highlight=False)
