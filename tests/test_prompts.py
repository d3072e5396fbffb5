"""The task prompts, and final-answer extraction for chain-of-thought output."""

import pytest

from icecache.prompts import document_prefix, extract_answer, qa_messages, render, summarize_messages


@pytest.mark.parametrize(
    "text,answer",
    [
        ("Each box has 12. 3 * 12 = 36. 36 - 5 = 31.\nAnswer: 31", "31"),
        ("So the answer is 3 * 12 = 36 apples.", "36"),
        ("The final answer is $1,250.00.", "1250"),
        ("Answer: -4", "-4"),
        ("Answer: 2.50 dollars", "2.5"),
        ("First 2, then 7 more, so 9 in all", "9"),
        ("Answer: Paris.", "Paris"),
        ("no numbers here", ""),
        ("Answer: 10\nWait, recheck. Answer: 12", "12"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


class _PlainTokenizer:
    """A base model's tokenizer (no chat template): one id per character."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def test_a_qa_prompt_asks_after_the_document_and_ends_with_the_question():
    text = qa_messages("  The ferry is the Silver Heron.\n", " What is the ferry called? ")[0]["content"]
    assert text == ("Here is a document.\n\nThe ferry is the Silver Heron.\n\n"
                    "Answer this question about the document above: What is the ferry called?")


def test_a_base_model_gets_the_answer_cue_once_and_the_document_prefix_is_shared():
    tok = _PlainTokenizer()
    doc = "Line one of the report. Line two."
    cued = "".join(map(chr, render(tok, qa_messages(doc, "Which line?", "find-cue"))))
    assert cued.endswith("Which line?\nAnswer:") and cued.count("Answer:") == 1  # a wording ending in it
    summary = "".join(map(chr, render(tok, summarize_messages(doc))))
    assert summary.endswith("\n\nAnswer:")  # other tasks get the cue added
    qa = "".join(map(chr, render(tok, qa_messages(doc, "Which line?"))))
    assert qa.endswith("Which line?\n\nAnswer:") and qa.count("Answer:") == 1  # the shipped one too
    n = document_prefix(tok, doc)
    assert qa[:n] == summary[:n] == cued[:n] and doc in qa[:n]  # the document cache's cut covers the document
