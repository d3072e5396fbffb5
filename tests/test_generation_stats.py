"""The decode figures a run prints (``GenerationStats.decode_line``)."""

from icecache.generation import GenerationStats


def test_the_decode_line_keeps_the_first_steps_set_up_apart():
    s = GenerationStats(tokens_out=5, decode_seconds=0.7, step_seconds=[0.6, 0.02, 0.03, 0.02, 0.03])
    line = s.decode_line()
    # the later steps' mean, not 0.7 s over five steps (140 ms a token)
    assert line.startswith("5 new tokens at 25.0 ms/token after the first step") and "600.0 ms" in line
    assert GenerationStats(tokens_out=1, decode_seconds=0.5, step_seconds=[0.5]).decode_line() == "1 new token in 500.0 ms"
