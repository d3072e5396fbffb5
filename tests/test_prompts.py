"""Final-answer extraction for chain-of-thought output."""

import pytest

from icecache.prompts import extract_answer


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
