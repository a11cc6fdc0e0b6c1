"""Anthropic's Messages API through the unchanged `anthropic` client, on a real server with the
built-in model (greedy, short answers): text, system, multi-turn, prefill, stop_sequences,
max_tokens, streaming (the same text and Anthropic's event order), a tools round trip,
count_tokens, and errors in Anthropic's shape (400 for bad input, never a 500).

The reference for what the model says is the same server's /v1/chat/completions: the Messages
route is a translation onto it, so a translated request must produce the same text."""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a [test] extra")

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0.0}  # Anthropic's newest clients take sampling fields as extra_body
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def client(client_apis_url: str):
    return anthropic.Anthropic(base_url=client_apis_url, api_key="x", max_retries=0, timeout=120)


def chat_text(url: str, messages: list[dict], max_tokens: int, **extra: object) -> tuple[str, str]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    choice = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_matches_chat_and_reports_usage(client, client_apis_url: str) -> None:
    msg = client.messages.create(model="default", max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    expected, finish = chat_text(client_apis_url, QUESTION, 16)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and text_of(msg) == expected and "Paris" in expected
    assert msg.stop_reason == ("end_turn" if finish == "stop" else "max_tokens")
    assert msg.stop_sequence is None
    usage = msg.usage
    count = client.messages.count_tokens(model="default", messages=QUESTION).input_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == count > 0
    assert 0 < usage.output_tokens <= 16


def test_system_and_multi_turn_match_chat(client, client_apis_url: str) -> None:
    system = "You are a terse geography teacher."
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "Name a country in Europe."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "France."}]},
        {"role": "user", "content": "And its capital?"},
    ]
    msg = client.messages.create(
        model="default",
        max_tokens=12,
        system=[{"type": "text", "text": system}],
        messages=turns,
        extra_body=GREEDY,
    )
    openai_turns = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Name a country in Europe."},
        {"role": "assistant", "content": "France."},
        {"role": "user", "content": "And its capital?"},
    ]
    assert text_of(msg) == chat_text(client_apis_url, openai_turns, 12)[0]
    with_system = client.messages.count_tokens(model="default", system=system, messages=turns).input_tokens
    without = client.messages.count_tokens(model="default", messages=turns).input_tokens
    assert with_system != without  # the system prompt replaced the template's default one


def test_assistant_prefill_is_continued(client, client_apis_url: str) -> None:
    turns = [*QUESTION, {"role": "assistant", "content": "The capital"}]
    msg = client.messages.create(model="default", max_tokens=8, messages=turns, extra_body=GREEDY)
    body = {"continue_final_message": True, "add_generation_prompt": False}
    assert text_of(msg) == chat_text(client_apis_url, turns, 8, **body)[0] != ""


def test_stop_sequence_and_max_tokens(client) -> None:
    full = client.messages.create(model="default", max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    text = text_of(full)
    word = "Paris"
    stopped = client.messages.create(
        model="default", max_tokens=16, messages=QUESTION, stop_sequences=[word], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text_of(stopped) == text[: text.index(word)]
    short = client.messages.create(model="default", max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_stream_equals_non_stream_with_anthropics_event_order(client, client_apis_url: str) -> None:
    kwargs = {"model": "default", "max_tokens": 16, "messages": QUESTION, "extra_body": GREEDY}
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))  # the client drops pings
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == text_of(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == text_of(whole)
        assert text_of(stream.get_final_message()) == text_of(whole)
    # On the wire: each event names its type twice (`event:` and the data's type), ping included.
    body = {"model": "default", "max_tokens": 4, "messages": QUESTION, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{client_apis_url}/v1/messages", json=body, timeout=120) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        blocks = resp.read().decode().strip().split("\n\n")
    pairs = [block.split("\n") for block in blocks]
    assert all(e.startswith("event: ") and d.startswith("data: ") for e, d in pairs)
    assert all(json.loads(d[6:])["type"] == e[7:] for e, d in pairs)
    assert [e[7:] for e, _ in pairs[:2]] == ["message_start", "ping"]


def test_tools_round_trip(client) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = {"model": "default", "max_tokens": 40, "tools": [WEATHER_TOOL], "extra_body": GREEDY}
    # tool_choice "any" forces a call (a grammar), so the small model's answer is a tool_use.
    msg = client.messages.create(messages=ask, tool_choice={"type": "any"}, **kwargs)
    assert msg.stop_reason == "tool_use"
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
    assert call.id.startswith("toolu_")
    with client.messages.stream(messages=ask, tool_choice={"type": "any"}, **kwargs) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    history = [
        *ask,
        {
            "role": "assistant",
            "content": [b.model_dump(include={"type", "id", "name", "input"}) for b in msg.content],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}],
        },
    ]
    answer = client.messages.create(messages=history, tool_choice={"type": "none"}, **kwargs)
    assert answer.stop_reason in ("end_turn", "max_tokens") and text_of(answer)
    assert all(b.type == "text" for b in answer.content)
    # The tool result reached the prompt: it is counted.
    counted = client.messages.count_tokens(
        model="default", messages=history, tools=[WEATHER_TOOL]
    ).input_tokens
    assert (
        counted
        > client.messages.count_tokens(
            model="default", messages=history[:2], tools=[WEATHER_TOOL]
        ).input_tokens
    )


def test_named_tool_choice_and_output_format(client) -> None:
    msg = client.messages.create(
        model="default",
        max_tokens=40,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL, {**WEATHER_TOOL, "name": "get_time"}],
        tool_choice={"type": "tool", "name": "get_time"},
        extra_body=GREEDY,
    )
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["get_time"]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    out = client.messages.create(
        model="default",
        max_tokens=40,
        messages=[{"role": "user", "content": "Give a city as JSON."}],
        extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert isinstance(json.loads(text_of(out))["city"], str)


def _anthropic_error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["message"]
    return body["error"]["type"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": QUESTION}, "max_tokens"),  # required, as in Anthropic's API
        ({"max_tokens": 0, "messages": QUESTION}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"max_tokens": 8, "messages": QUESTION, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "type"),
        (
            {
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
                ],
            },
            "image",
        ),
        (
            {"max_tokens": 8, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1024}},
            "thinking",
        ),
        ({"max_tokens": 8, "messages": QUESTION, "tool_choice": {"type": "any"}}, "tools"),
        (
            {"max_tokens": 8, "messages": QUESTION, "tools": [{"name": "x", "type": "web_search_20250305"}]},
            "tools",
        ),
    ],
)
def test_bad_input_is_a_400_in_anthropics_shape(client_apis_url: str, body: dict, needle: str) -> None:
    resp = httpx.post(f"{client_apis_url}/v1/messages", json={"model": "default", **body}, timeout=60)
    assert _anthropic_error(resp, 400) == "invalid_request_error"
    assert needle in resp.json()["error"]["message"]


def test_other_errors_keep_their_status_in_anthropics_shape(client, client_apis_url: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="claude-nonexistent", max_tokens=8, messages=QUESTION)
    assert exc.value.body["error"]["type"] == "not_found_error"
    resp = httpx.post(
        f"{client_apis_url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert _anthropic_error(resp, 400) == "invalid_request_error"
    resp = httpx.post(f"{client_apis_url}/v1/messages", content=b"x", headers={"content-type": "text/plain"})
    assert _anthropic_error(resp, 415) == "invalid_request_error"
    resp = httpx.get(f"{client_apis_url}/v1/messages")
    assert _anthropic_error(resp, 405) == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="default", messages=[])
