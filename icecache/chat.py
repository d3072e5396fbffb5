"""Chat templates and end-of-turn tokens for models whose files carry no template.

A GGUF often holds the weights and the vocabulary but no chat template (the Gemma 3 270M file
does not), and its end token (``<eos>``) is not the one a turn ends with (``<end_of_turn>``):
without help such a model answers and then keeps writing the next question. Two things follow:

- A reply stops at the family's end-of-turn tokens too (:func:`end_token_ids`), whatever the
  prompt's form.
- The prompt's form (``chat_template``): ``auto`` uses the model's own template, and plain text
  (ending in ``Answer:``, :func:`~.prompts.render`) where it has none; ``family`` gives such a
  model its family's template where the family is known and its vocabulary holds the family's
  turn tokens; ``plain`` always plain text. ``auto`` does not reach for the family's template:
  a file without one is usually a base model, and the Gemma 3 270M base model under Gemma's turns
  repeated its prompt on every passkey, locker and log document asked (0 of 12 at 1k), where plain
  text answered 5 of 12 (docs/prompts.md, "A base model").

The templates are written here from the families' published formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # transformers' ``model_type`` values of the family
    marker: str | None  # a token the vocabulary must hold for the template to apply (None: any)
    template: str  # Jinja, as transformers' ``apply_chat_template`` renders it
    ends: tuple[str, ...]  # the tokens a reply ends with


GEMMA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
    "{% else %} {{ m['content'] | trim }}{{ eos_token }}{% endif %}{% endfor %}"
)

FAMILIES = (
    Family("gemma", ("gemma", "gemma2", "gemma3", "gemma3_text"), "<start_of_turn>", GEMMA, ("<end_of_turn>",)),
    Family("llama3", ("llama",), "<|start_header_id|>", LLAMA3, ("<|eot_id|>", "<|eom_id|>")),
    Family("chatml", ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"), "<|im_start|>", CHATML, ("<|im_end|>",)),
    Family("mistral", ("mistral",), None, MISTRAL, ()),
)


def family_of(model_type: str, tokenizer: Any) -> Family | None:
    """The family whose template fits a model of ``model_type`` with this vocabulary, or None."""
    vocab = tokenizer.get_vocab()  # (a copy: built once here, a 262k-entry dict for Gemma)
    for fam in FAMILIES:
        if model_type in fam.model_types and (fam.marker is None or fam.marker in vocab):
            return fam
    return None


CHOICES = ("auto", "family", "plain")  # the chat_template setting


def adopt_template(tokenizer: Any, model_type: str, choice: str = "auto") -> str:
    """Set up ``tokenizer`` for the prompts' form ``choice`` (:data:`CHOICES`); returns the form:
    ``own`` (the model's template), a family's name (its template given to the tokenizer), or
    ``plain``. ``ValueError`` for ``family`` where no known family's template fits the model."""
    own = bool(getattr(tokenizer, "chat_template", None))
    if choice == "plain":
        tokenizer.chat_template = None
        return "plain"
    if own:
        return "own"
    if choice == "auto":
        return "plain"
    fam = family_of(model_type, tokenizer)
    if fam is None:
        raise ValueError(f"chat_template: family: no known family's template fits a '{model_type}' model "
                         f"(known: {', '.join(f.name for f in FAMILIES)})")
    tokenizer.chat_template = fam.template
    return fam.name


def end_token_ids(tokenizer: Any, model_type: str) -> set[int]:
    """The end-of-turn tokens of the model's family that its vocabulary holds (whatever template
    the prompts use: a base model may still close a turn with them)."""
    vocab = tokenizer.get_vocab()
    return {vocab[t] for fam in FAMILIES if model_type in fam.model_types for t in fam.ends if t in vocab}


def stop_cues(loaded: Any) -> tuple[str, ...]:
    """Where a plain-text reply ends (a model without a chat template, which has no end of turn):
    a new line that starts with one of the prompt's own labels (``Question:``, ``Answer:``). A
    base model that has answered goes on to write the next question and answer of an imagined
    exam; a line of its reply that opens with those labels is where its answer ended."""
    from .prompts import CUE_LABELS

    return tuple("\n" + label for label in CUE_LABELS) if getattr(loaded, "template", "") == "plain" else ()


# tokens decoded at each step to look for a stop cue: more than a cue's new line and label take
CUE_TOKENS = 12


def cut_at_cue(tokenizer: Any, out: list[int], cues: tuple[str, ...]) -> bool:
    """Whether the reply ``out`` has just opened a line with a stop cue (:func:`stop_cues`); if so
    its tokens from the one holding that new line on are dropped. Only the last few tokens are
    decoded, so a long reply costs no more per step."""
    if not any(cue in tokenizer.decode(out[-CUE_TOKENS:]) for cue in cues):
        return False
    start = len(out) - 1  # back to the latest token from which the reply still holds the cue
    while not any(cue in tokenizer.decode(out[start:]) for cue in cues):
        start -= 1
    del out[start:]
    return True


def stop_token_ids(loaded: Any) -> set[int]:
    """Where a reply ends: the end tokens of the model's generation config and tokenizer, and its
    family's end-of-turn tokens (a GGUF's config names ``<eos>`` alone, Gemma replies end with
    ``<end_of_turn>``)."""
    ids: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids | loaded.end_ids
