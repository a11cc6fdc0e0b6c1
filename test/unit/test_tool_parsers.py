"""Tool-call parsers (hermes, llama3, the forced JSON array): whole text, malformed text and the
same text streamed one character at a time must agree."""

from __future__ import annotations

import json

import pytest

from radixserve.entrypoints.openai.chat_tools import ChatPlan, ChoiceStream, forced_calls_schema, split_output
from radixserve.entrypoints.openai.protocol import NamedToolChoice, Tool
from radixserve.entrypoints.openai.tool_calls import ToolCallStream, parse_tool_calls, resolve_parser

HERMES_TWO = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
WELL_FORMED = [
    (
        "hermes",
        HERMES_TWO,
        "Let me check.",
        [("get_weather", {"city": "Paris", "n": [1, {"a": "}"}]}), ("now", {})],
    ),
    ("hermes", 'Sure <tool_call>{"name": "f"}</tool_call>', "Sure", [("f", {})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"q": "x \\" y"}}', "", [("f", {"q": 'x " y'})]),
    (
        "llama3",
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": 2}}',
        "",
        [("f", {"a": 1}), ("g", {"b": 2})],
    ),
    ("llama3", '{"name": "f", "parameters": "{\\"a\\": 1}"}', "", [("f", {"a": 1})]),
    (
        "json_array",
        '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"y": "z"}}]',
        "",
        [("f", {"x": 1}), ("g", {"y": "z"})],
    ),
]
MALFORMED = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call> tail'),  # unbalanced
    ("hermes", '<tool_call>{"arguments": {"x": 1}}</tool_call>'),  # no name
    ("hermes", "just text with a <tool_call mention"),
    ("llama3", 'Hello {"name": "f", "parameters": {}}'),  # not at the start: plain text
    ("llama3", '{"name": "f", "parameters": {"x": '),  # cut off
]


def stream_all(fmt: str, text: str) -> tuple[str, dict[int, list[str]]]:
    st = ToolCallStream(fmt)
    content, calls = "", {}
    for end in [*range(1, len(text) + 1), None]:
        piece, deltas = st.feed(text[:end] if end else text, final=end is None)
        content += piece
        for d in deltas:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.name or ""
            entry[1] += d.arguments
    return content, calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), WELL_FORMED)
def test_well_formed_whole_and_streamed(fmt: str, text: str, content: str, calls: list) -> None:
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    s_content, s_calls = stream_all(fmt, text)
    assert s_content.strip() == content
    assert [(n, json.loads(a)) for n, a in s_calls.values()] == calls


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_text_stays_content(fmt: str, text: str) -> None:
    content, calls = parse_tool_calls(text, fmt)
    assert calls == [] and content == text
    s_content, _ = stream_all(fmt, text)
    assert s_content == text or s_content.endswith("tail")  # nothing the model wrote is lost


def test_content_is_not_held_back_longer_than_a_partial_tag() -> None:
    st = ToolCallStream("hermes")
    assert st.feed("Hello <tool")[0] == "Hello "
    assert st.feed("Hello <tooltip>")[0] == "<tooltip>"


def test_parser_names() -> None:
    assert resolve_parser(None) == "hermes" and resolve_parser("qwen25") == "hermes"
    assert resolve_parser("llama3") == "llama3"
    with pytest.raises(ValueError):
        resolve_parser("nope")


def test_forced_schema_shapes() -> None:
    tools = [Tool.model_validate({"function": {"name": n, "parameters": {"type": "object"}}}) for n in "ab"]
    required = forced_calls_schema(tools, "required", parallel=True)
    assert required["minItems"] == 1 and "maxItems" not in required and len(required["items"]["anyOf"]) == 2
    named = forced_calls_schema(tools, NamedToolChoice(function={"name": "b"}), parallel=True)
    assert named["maxItems"] == 1 and named["items"]["properties"]["name"] == {"const": "b"}
    with pytest.raises(ValueError, match="not in 'tools'"):
        forced_calls_schema(tools, NamedToolChoice(function={"name": "c"}), parallel=True)


def test_choice_stream_openai_deltas() -> None:
    plan = ChatPlan(input_ids=[], tool_format="hermes", reasoning_parser="qwen3")
    text = '<think>need weather</think>\n\nOk.<tool_call>{"name": "w", "arguments": {"c": "P"}}</tool_call>'
    stream = ChoiceStream(plan)
    deltas = [stream.feed(text[:i], final=False) for i in range(1, len(text) + 1)]
    deltas.append(stream.feed(text, final=True))
    deltas = [d for d in deltas if d is not None]
    assert "".join(d.reasoning_content or "" for d in deltas) == "need weather"
    assert "".join(d.content or "" for d in deltas) == "Ok."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "w" and calls[0].index == 0
    assert all(tc.id is None for tc in calls[1:])
    assert json.loads("".join(tc.function.arguments for tc in calls)) == {"c": "P"}
    whole = split_output(text, plan)
    assert whole.reasoning_content == "need weather" and whole.content == "Ok."
    assert whole.tool_calls[0].function.name == "w"
