"""Structured outputs and tool calling through the real server (openai client) on the tiny model:
response_format, extra_body regex / ebnf on both OpenAI routes, 400s for bad specs, a grammar
compile timeout that leaves the server healthy, and tool_choice "required" / named / streamed."""

from __future__ import annotations

import json
import os
import re
import sys

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("xgrammar")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import TINY_POOL_TOKENS, Server, start_servers  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "Plan a trip."}]


@pytest.fixture(scope="module")
def grammar_servers(servers: dict[str, Server], tiny_llama_path: str) -> dict[str, Server]:
    """main: the session's tiny-model server (conftest's, shared); slow: its own, where every fresh
    grammar times out at once (cached or unconstrained requests still work)."""
    flags = ("--max-total-tokens", str(TINY_POOL_TOKENS), "--grammar-compile-timeout", "0.000001")
    slow = Server.real(tiny_llama_path, *flags)
    try:
        yield {"main": servers["tiny"], **start_servers({"slow": slow})}
    finally:
        slow.stop()


@pytest.fixture(scope="module")
def client(grammar_servers: dict[str, Server]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{grammar_servers['main'].url}/v1", api_key="none", max_retries=0)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 0.8):
        resp = client.chat.completions.create(
            model="default",
            messages=ASK,
            max_tokens=200,
            temperature=temperature,
            seed=1,
            response_format=fmt,
        )
        jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
        assert resp.choices[0].finish_reason == "stop"


def test_response_format_json_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="default", messages=ASK, max_tokens=64, response_format={"type": "json_object"}
    )
    text, reason = resp.choices[0].message.content, resp.choices[0].finish_reason
    assert text.startswith("{")
    if reason == "stop":  # a random model may still be inside a key when max_tokens runs out
        assert isinstance(json.loads(text), dict)


def test_extra_body_regex_and_ebnf_on_both_routes(client: openai.OpenAI) -> None:
    date = r"\d{4}-\d{2}-\d{2}"
    chat = client.chat.completions.create(
        model="default", messages=ASK, max_tokens=20, extra_body={"regex": date}
    )
    assert re.fullmatch(date, chat.choices[0].message.content)
    comp = client.completions.create(
        model="default", prompt="Date:", max_tokens=20, extra_body={"regex": "(yes|no)"}
    )
    assert comp.choices[0].text in ("yes", "no")
    ebnf = 'root ::= "answer: " ("yes" | "no")'
    chat = client.chat.completions.create(
        model="default", messages=ASK, max_tokens=20, extra_body={"ebnf": ebnf}
    )
    assert chat.choices[0].message.content in ("answer: yes", "answer: no")
    stream = client.completions.create(
        model="default", prompt="x", max_tokens=20, stream=True, extra_body={"regex": date}
    )
    assert re.fullmatch(date, "".join(c.choices[0].text for c in stream if c.choices))


def test_invalid_specs_are_400_with_the_reason(
    grammar_servers: dict[str, Server], client: openai.OpenAI
) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError, match="objectx"):
        client.chat.completions.create(model="default", messages=ASK, response_format=bad_schema)
    with pytest.raises(openai.BadRequestError, match="parenthesis"):
        client.completions.create(model="default", prompt="x", extra_body={"regex": "(abc"})
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        client.completions.create(model="default", prompt="x", extra_body={"json_schema": "{nope"})
    with pytest.raises(openai.BadRequestError, match="Only one of"):
        client.completions.create(
            model="default", prompt="x", extra_body={"regex": "a", "ebnf": 'root ::= "a"'}
        )
    resp = httpx.post(
        f"{grammar_servers['main'].url}/generate",
        json={"text": "x", "sampling_params": {"ebnf": "root ::= nope"}},
    )
    assert resp.status_code == 400 and "nope" in resp.json()["error"]["message"]


def test_compile_timeout_ends_request_and_server_stays_healthy(grammar_servers: dict[str, Server]) -> None:
    url = grammar_servers["slow"].url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError, match="timed out") as info:
        client.chat.completions.create(
            model="default",
            messages=ASK,
            max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
        )
    assert info.value.status_code == 503
    assert httpx.get(f"{url}/health").status_code == 200
    ok = client.completions.create(model="default", prompt="x", max_tokens=4, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 4


def _check_call(call: object, tools: dict[str, dict]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    schema = tools[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    tools = {"get_weather": WEATHER, "get_time": TIME}
    # One call: with parallel calls allowed, the grammar lets a random model append calls until
    # max_tokens, so whether it stops would be a matter of the sampler's luck.
    resp = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=120,
        tools=list(tools.values()),
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call, tools)
    named = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=120,
        tools=list(tools.values()),
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call, tools)
    none = client.chat.completions.create(
        model="default", messages=ASK, max_tokens=8, tools=list(tools.values()), tool_choice="none"
    )
    assert none.choices[0].message.tool_calls is None


def test_tool_calls_stream_in_openai_shape(client: openai.OpenAI) -> None:
    tools = {"get_weather": WEATHER, "get_time": TIME}
    stream = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=120,
        tools=list(tools.values()),
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "args": ""})
                entry["name"] += tc.function.name or ""
                entry["args"] += tc.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    entry = calls[0]
    assert entry["id"].startswith("call_")
    jsonschema.validate(json.loads(entry["args"]), tools[entry["name"]]["function"]["parameters"])


def test_unknown_named_tool_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        client.chat.completions.create(
            model="default",
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
