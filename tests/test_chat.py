"""Chat templates and end-of-turn tokens for models whose files carry none (icecache.chat)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from icecache.chat import adopt_template, end_token_ids, stop_token_ids
from icecache.models import LoadedModel
from icecache.prompts import qa_messages, render

WORDS = ["<pad>", "<eos>", "<bos>", "<unk>", "Here", "is", "a", "document.", "Rain", "falls.", "Answer:", "?",
         "user", "model"]


def tokenizer(extra: list[str], template: str | None = None):
    """A word-level tokenizer over ``WORDS`` and ``extra`` (special tokens split out whole)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS + extra)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=extra)
    fast.chat_template = template
    return fast


def test_a_gemma_vocabulary_without_a_template_gets_gemmas_turns_and_stops_at_end_of_turn():
    tok = tokenizer(["<start_of_turn>", "<end_of_turn>"])
    assert adopt_template(tok, "gemma3_text") == "plain"  # auto: no template of its own, plain text
    assert tok.chat_template is None
    assert adopt_template(tok, "gemma3_text", "family") == "gemma"
    tokens = tok.convert_ids_to_tokens(render(tok, qa_messages("Rain falls.", "?")))
    assert tokens[:3] == ["<bos>", "<start_of_turn>", "user"]
    assert tokens[-4:] == ["?", "<end_of_turn>", "<start_of_turn>", "model"]  # the reply is the model's turn
    assert end_token_ids(tok, "gemma3_text") == {tok.convert_tokens_to_ids("<end_of_turn>")}


@pytest.mark.parametrize("model_type,extra", [
    ("llama", []),  # a Llama 2 vocabulary: no Llama 3 header tokens
    ("phi3", ["<|im_start|>", "<|im_end|>"]),  # a family without a template here
    ("gemma3_text", []),  # Gemma by its type, but the turn tokens are missing
])
def test_no_known_template_fits_so_the_family_choice_is_refused(model_type, extra):
    tok = tokenizer(extra)
    with pytest.raises(ValueError, match="no known family"):
        adopt_template(tok, model_type, "family")
    assert adopt_template(tok, model_type) == "plain"
    assert tok.chat_template is None
    assert tok.decode(render(tok, qa_messages("Rain falls.", "?"))).split()[-1] == "Answer:"


def test_the_models_own_template_is_kept():
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = tokenizer(["<start_of_turn>", "<end_of_turn>"], template=own)
    assert adopt_template(tok, "gemma3_text") == "own"
    assert adopt_template(tok, "gemma3_text", "family") == "own"
    assert tok.chat_template == own
    assert adopt_template(tok, "gemma3_text", "plain") == "plain" and tok.chat_template is None


@pytest.mark.parametrize("model_type,extra,want", [
    ("qwen2", ["<|im_start|>", "<|im_end|>"], "chatml"),
    ("llama", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "llama3"),
    ("mistral", [], "mistral"),
])
def test_other_families_templates_render_a_turn_ready_for_the_reply(model_type, extra, want):
    tok = tokenizer(extra)
    assert adopt_template(tok, model_type, "family") == want
    text = tok.decode(render(tok, qa_messages("Rain falls.", "?")))
    assert "Rain falls." in text
    ends = end_token_ids(tok, model_type)
    assert ends == {tok.convert_tokens_to_ids(t) for t in extra if t in ("<|im_end|>", "<|eot_id|>")}


def test_a_reply_stops_at_the_config_end_token_and_the_familys_end_of_turn():
    tok = tokenizer(["<start_of_turn>", "<end_of_turn>"])
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=1))
    loaded = LoadedModel(model=model, tokenizer=tok, name="t", context_length=32, load_seconds=0.0,
                         end_ids=frozenset(end_token_ids(tok, "gemma3_text")))
    assert stop_token_ids(loaded) == {1, tok.convert_tokens_to_ids("<end_of_turn>")}


def test_the_settings_choices_are_the_modules():
    from icecache import chat, config

    assert config.CHAT_CHOICES == chat.CHOICES


class _Chars:
    """A tokenizer of one character per token (ids are code points)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_a_plain_reply_ends_where_it_opens_a_line_with_the_prompts_labels():
    from types import SimpleNamespace

    from icecache.chat import cut_at_cue, stop_cues

    assert stop_cues(SimpleNamespace(template="gemma")) == ()  # a template ends turns by tokens
    cues = stop_cues(SimpleNamespace(template="plain"))
    assert cues == ("\nQuestion:", "\nAnswer:")
    tok, out, cut_after = _Chars(), [], None
    for i, ch in enumerate(" Lisbon.\nQuestion: What is the budget?"):
        out.append(ord(ch))
        if cut_at_cue(tok, out, cues):
            cut_after = i
            break
    assert tok.decode(out) == " Lisbon." and cut_after == len(" Lisbon.\nQuestion:") - 1
    # a label inside a line, or a line that starts otherwise, goes on
    out = [ord(c) for c in " The Answer: Lisbon.\nThe end"]
    assert not cut_at_cue(tok, out, cues) and len(out) == len(" The Answer: Lisbon.\nThe end")
