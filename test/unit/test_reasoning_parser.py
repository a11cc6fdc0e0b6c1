"""--reasoning-parser: <think>...</think> split from the answer, whole and streamed."""

from __future__ import annotations

import pytest

from radixserve.entrypoints.openai.reasoning import ReasoningStream, split_reasoning

CASES = [
    ("qwen3", "<think>\nlet me think</think>\n\nThe answer is 4.", "let me think", "The answer is 4."),
    ("qwen3", "A direct answer.", None, "A direct answer."),
    ("qwen3", "<think>cut off before the end", "cut off before the end", ""),
    ("deepseek-r1", "reasoning first</think>answer", "reasoning first", "answer"),
    ("deepseek-r1", "<think>r</think>a", "r", "a"),
    ("deepseek-r1", "never closed", "never closed", ""),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_whole_and_streamed(parser: str, text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, parser) == (reasoning, content)
    stream = ReasoningStream.for_parser(parser)
    got_r = got_c = ""
    for end in range(1, len(text) + 1):
        r, c = stream.feed(text[:end])
        got_r, got_c = got_r + r, got_c + c
    r, c = stream.feed(text, final=True)
    got_r, got_c = got_r + r, got_c + c
    assert got_r.strip() == (reasoning or "") and got_c == content


def test_partial_tags_are_held_back() -> None:
    stream = ReasoningStream.for_parser("qwen3")
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("<think>abc</th") == ("abc", "")
    assert stream.feed("<think>abc</think>x") == ("", "x")


def test_unknown_parser() -> None:
    with pytest.raises(ValueError):
        ReasoningStream.for_parser("nope")
