"""Option declarations shared by the commands, declared once.

The task commands (summarize, qa, cot) take the same run options; :func:`with_options` adds a
group of them to a command's own parameters and hands them over as one object (``RunOptions``,
``BenchOptions``), so that each command states only what is its own.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Annotated, Any

import typer

from icecache.methods import METHODS


def _profile_setting(kind: Any, *names: str, about: str, **checks: Any) -> Any:
    """An option that overrides a profile setting: no default of its own (None: the profile's)."""
    return Annotated[kind | None, typer.Option(*names, help=f"{about} Default: the profile's.", show_default=False, **checks)]


FileArg = Annotated[str | None, typer.Argument(
    metavar="FILE", help="Document to read; '-' (or a pipe and no FILE) reads stdin.", show_default=False)]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", show_default=False,
    help="HF model id (local cache), model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")]
ProfileOpt = Annotated[str | None, typer.Option(
    "--profile", "-p", show_default=False,
    help="Hardware profile name (see `icecache profiles`) or YAML path. Default: cpu without CUDA.")]


def method_lines() -> str:
    """Every method with its one-line summary, one paragraph (shown as one line) each: the
    epilog of the commands that take ``--method``."""
    return "KV-cache methods (--method):\n\n" + "\n\n".join(
        f"{m.name}: {m.summary}" + ("" if m.budgeted else " (no --budget)") for m in METHODS.values())


MethodOpt = Annotated[str, typer.Option("--method", help=f"KV-cache method: {', '.join(METHODS)} (each described below).")]
BudgetOpt = _profile_setting(int, "--budget", about="Tokens of selected KV pages per head (a multiple of the page size).")
ReuseOpt = _profile_setting(int, "--reuse-every", min=1, about=(
    "ice-reuse: one layer in N queries its index, the next N-1 reuse its pages (the profile's: 3)."))
PrefillOpt = _profile_setting(str, "--prefill", about=(
    "full: each chunk attends to everything before it; sparse: to the sink, the pages the index "
    "selects and a window (memory and time grow linearly; ice, ice-reuse, streaming, quest); "
    "auto: full while the prompt fits the trained context and the memory, sparse beyond."))
PositionsOpt = _profile_setting(str, "--positions", about=(
    "RoPE positions past the model's trained context: remap (every attended token at a distance "
    "the model knows), true, or auto (remap when prompt + generation outgrow it)."))
RopeScalingOpt = _profile_setting(str, "--rope-scaling", about=(
    "RoPE scaling for a run past the trained context: none, linear, dynamic (NTK) or yarn "
    "(transformers' own; positions stay true). The peer of --positions remap."))
WeightsOpt = _profile_setting(str, "--weights", about=(
    "The linear layers' weights: float (the model's dtype), int8 (one scale per output channel), "
    "int4 (groups of 32 with a step and a minimum each, exact for a Q4_1 GGUF's layers; the LM "
    "head's int8 logits checked against the float weights wherever the largest could be), or auto "
    "(int4 where it holds the model's weights exactly, else float). int8 and int4 run on the CPU only; "
    "decode reads a quarter or an eighth of float32's bytes."))
ChatTemplateOpt = _profile_setting(str, "--chat-template", about=(
    "The prompts' form for a model file without a chat template: auto (plain text; the model's "
    "own template where it has one), family (its family's: Gemma, Llama 3, ChatML, Mistral) or "
    "plain. A reply also stops at the family's end-of-turn token."))
ChunkOpt = _profile_setting(int, "--chunk-size", min=1, about="Prompt tokens per prefill chunk (a multiple of the page size).")
PipelineOpt = _profile_setting(bool, "--pipeline/--no-pipeline", about=(
    "Offload and index each layer in the background while the next computes (the profile's: on)."))
DocCacheOpt = Annotated[str | None, typer.Option(
    "--doc-cache", metavar="DIR", show_default=False,
    help="Folder of the document cache: a document's prefill saved there is loaded by a later run "
         "over the same document. Default: the profile's doc_cache, else $ICECACHE_DOC_CACHE, else "
         "the user cache folder.")]
NoDocCacheOpt = Annotated[bool, typer.Option("--no-doc-cache", help="Neither load nor save the document's prefill.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
StatsOpt = Annotated[bool, typer.Option("--stats", help="Print the final figures (prefill, per-token latency, memory, pages) as one line on stderr; JSON with --json.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="Nothing on stderr but errors.")]


def max_new_opt(help_text: str = "Most tokens to generate."):
    return Annotated[int, typer.Option("--max-new-tokens", min=1, help=help_text)]


def penalty_opt():
    return Annotated[float, typer.Option("--repetition-penalty", min=1.0, max=2.0,
                                         help="Penalty on repeating tokens already generated (1 = none).")]


@dataclass
class RunOptions:
    """The options of every task command (summarize, qa, cot)."""

    model: ModelOpt = None
    profile: ProfileOpt = None
    method: MethodOpt = "ice"
    budget: BudgetOpt = None
    reuse_every: ReuseOpt = None
    prefill: PrefillOpt = None
    positions: PositionsOpt = None
    rope_scaling: RopeScalingOpt = None
    weights: WeightsOpt = None
    chat_template: ChatTemplateOpt = None
    chunk_size: ChunkOpt = None
    pipeline: PipelineOpt = None
    doc_cache: DocCacheOpt = None
    no_doc_cache: NoDocCacheOpt = False
    as_json: JsonOpt = False
    stats: StatsOpt = False
    quiet: QuietOpt = False

    def flags(self) -> dict:
        """The settings given as flags (``None``: the profile's)."""
        return dict(budget=self.budget, reuse_every=self.reuse_every, prefill=self.prefill,
                    chunk_size=self.chunk_size, pipeline=self.pipeline, positions=self.positions,
                    rope_scaling=self.rope_scaling, weights=self.weights, chat_template=self.chat_template,
                    doc_cache="off" if self.no_doc_cache else self.doc_cache)


@dataclass
class BenchOptions:
    """The tail of options the bench subcommands share."""

    budget: Annotated[int | None, typer.Option("--budget", help="Budget in tokens (default: the profile's).", show_default=False)] = None
    profile: Annotated[str | None, typer.Option("--profile", "-p", help="Hardware profile.", show_default=False)] = None
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (default: embedded).", show_default=False)] = None
    weights: Annotated[str | None, typer.Option("--weights", help="The linear layers' weights: float, int8, int4 (CPU) or auto. Default: the profile's.", show_default=False)] = None
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document as the last stdout line.")] = False
    quiet: QuietOpt = False


def with_options(into: str, group: type) -> Any:
    """Decorator: the command also takes every field of the dataclass ``group`` as an option,
    and receives them as one ``group`` object in its parameter ``into``."""
    import typing

    hints = typing.get_type_hints(group, include_extras=True)
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=hints[f.name]) for f in fields(group)]

    def decorate(func):
        sig = inspect.signature(func, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values()
               if p.name != into]

        @functools.wraps(func)
        def command(**kwargs):
            shared = group(**{f.name: kwargs.pop(f.name) for f in fields(group)})
            return func(**kwargs, **{into: shared})

        del command.__wrapped__  # typer reads the signature below, not the wrapped function's
        params = own + extra
        command.__signature__ = sig.replace(parameters=params, return_annotation=None)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
