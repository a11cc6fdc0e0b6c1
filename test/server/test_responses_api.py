"""OpenAI's Responses API through the unchanged `openai` client, on a real server with the
built-in model (greedy, short answers): text, multi-turn via previous_response_id (the chain hits
the radix cache), streaming (the same text, OpenAI's event order, sequence numbers), a tools round
trip, structured output, the store (retrieve, input_items, delete), background responses (poll,
cancel, stream resume with starting_after), errors (400 naming the field, 404), and a restart
with --storage-dir (a stored response survives; a running background response is failed).

The reference for what the model says is the same server's /v1/chat/completions: the Responses
route is a translation onto it, so a translated request must produce the same text."""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import BUILTIN_POOL_TOKENS, Server, start_servers, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(300)

QUESTION = "What is the capital of France?"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
LONG = {"input": "Write a very long story about a cat.", "max_output_tokens": 2000, "temperature": 0.0}


def openai_client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(client_apis_url: str) -> OpenAI:
    return openai_client(client_apis_url)


def chat_text(url: str, messages: list[dict], max_tokens: int) -> str:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"][
        "content"
    ]


def test_text_matches_chat_and_is_stored(client: OpenAI, client_apis_url: str) -> None:
    resp = client.responses.create(model="default", input=QUESTION, max_output_tokens=16, temperature=0.0)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    assert resp.created_at > 0 and resp.completed_at >= resp.created_at
    assert [item.type for item in resp.output] == ["message"] and resp.output[0].status == "completed"
    expected = chat_text(client_apis_url, [{"role": "user", "content": QUESTION}], 16)
    assert resp.output_text == expected and "Paris" in expected
    usage = resp.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 16
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    items = list(client.responses.input_items.list(resp.id))
    assert len(items) == 1 and items[0].role == "user" and items[0].content[0].text == QUESTION
    client.responses.delete(resp.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(resp.id)


def test_instructions_and_a_cut_answer(client: OpenAI, client_apis_url: str) -> None:
    system = "You are a terse geography teacher."
    resp = client.responses.create(
        model="default", instructions=system, input=QUESTION, max_output_tokens=3, temperature=0.0
    )
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    assert resp.output_text == chat_text(client_apis_url, messages, 3)


def test_previous_response_id_continues_the_conversation_from_the_cache(
    client: OpenAI, client_apis_url: str
) -> None:
    first = client.responses.create(model="default", input=QUESTION, max_output_tokens=16, temperature=0.0)
    second = client.responses.create(
        model="default",
        previous_response_id=first.id,
        input="And of Germany?",
        max_output_tokens=16,
        temperature=0.0,
    )
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Germany?"},
    ]
    assert second.output_text == chat_text(client_apis_url, messages, 16)
    # The chain's prompt starts with the first turn's: the radix cache serves it.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens > 0
    with pytest.raises(BadRequestError, match="previous_response_id"):
        client.responses.create(
            model="default", previous_response_id="resp_missing", input="x", max_output_tokens=2
        )


def test_stream_equals_non_stream_with_openais_event_order(client: OpenAI) -> None:
    kwargs = {"model": "default", "input": QUESTION, "max_output_tokens": 16, "temperature": 0.0}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert (
        streamed == whole.output_text == final.output_text
        and final.usage.output_tokens == whole.usage.output_tokens
    )
    assert client.responses.retrieve(final.id).output_text == streamed  # stored before the last event
    with client.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_tools_round_trip(client: OpenAI) -> None:
    tools = [WEATHER_TOOL]
    ask = {"model": "default", "tools": tools, "temperature": 0.0, "max_output_tokens": 40}
    called = client.responses.create(input="What is the weather in Paris?", tool_choice="required", **ask)
    assert [item.type for item in called.output] == ["function_call"]
    call = called.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    events = list(
        client.responses.create(
            input="What is the weather in Paris?", tool_choice="required", stream=True, **ask
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done[0].arguments == call.arguments
    answer = client.responses.create(
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}],
        tool_choice="none",
        **ask,
    )
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    history = list(client.responses.input_items.list(answer.id))
    assert [item.type for item in history] == ["function_call_output"]


def test_structured_output_follows_the_schema(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model="default",
        input="Give me a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        temperature=0.0,
        max_output_tokens=40,
    )
    assert set(json.loads(resp.output_text)) == {"name"}


def test_background_completes_and_its_stream_resumes(client: OpenAI) -> None:
    kwargs = {"model": "default", "input": QUESTION, "max_output_tokens": 16, "temperature": 0.0}
    whole = client.responses.create(**kwargs)
    queued = client.responses.create(background=True, **kwargs)
    assert queued.background and queued.status in ("queued", "in_progress")
    done = wait_until(
        lambda: (r := client.responses.retrieve(queued.id)).status not in ("queued", "in_progress") and r,
        120,
        "done",
    )
    assert done.status == "completed" and done.output_text == whole.output_text
    stream = client.responses.create(background=True, stream=True, **kwargs)
    head = []
    for event in stream:
        head.append(event)
        if len(head) == 5:
            break
    stream.response.close()
    rid = head[0].response.id
    tail = list(client.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    events = head + tail
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "queued" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    again = list(client.responses.retrieve(rid, stream=True, starting_after=len(events) - 3))
    assert [e.sequence_number for e in again] == [len(events) - 2, len(events) - 1]


def test_cancel_a_background_response(client: OpenAI) -> None:
    started = client.responses.create(model="default", background=True, **LONG)
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"
    assert client.responses.cancel(started.id).status == "cancelled"  # cancelling again changes nothing
    foreground = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    with pytest.raises(BadRequestError, match="background"):
        client.responses.cancel(foreground.id)


def test_errors_name_the_field(client: OpenAI, client_apis_url: str) -> None:
    with pytest.raises(BadRequestError, match="frequency_penalty"):
        client.responses.create(model="default", input="x", extra_body={"frequency_penalty": 1.0})
    with pytest.raises(BadRequestError, match="tools.0.type"):
        client.responses.create(model="default", input="x", tools=[{"type": "web_search"}])
    with pytest.raises(BadRequestError, match="reasoning"):
        client.responses.create(model="default", input="x", reasoning={"effort": "low"})
    with pytest.raises(BadRequestError, match="background"):
        client.responses.create(model="default", input="x", background=True, store=False)
    with pytest.raises(NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(NotFoundError):
            call("resp_missing")
    with pytest.raises(NotFoundError):
        client.responses.input_items.list("resp_missing")
    unstored = client.responses.create(model="default", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)
    resp = httpx.get(f"{client_apis_url}/v1/responses/x/input_items", params={"limit": 0}, timeout=30)
    assert resp.status_code == 400 and "limit" in resp.json()["error"]["message"]


def test_a_restart_keeps_stored_responses_and_fails_running_ones(builtin_model_path: str, tmp_path) -> None:
    flags = ("--max-total-tokens", str(BUILTIN_POOL_TOKENS), "--storage-dir", str(tmp_path))
    server = start_servers({"s": Server.real(builtin_model_path, *flags)})["s"]
    try:
        client = openai_client(server.url)
        stored = client.responses.create(
            model="default", input=QUESTION, max_output_tokens=8, temperature=0.0
        )
        running = client.responses.create(model="default", background=True, **LONG)
        wait_until(lambda: client.responses.retrieve(running.id).status == "in_progress", 120, "in progress")
        server.proc.kill()  # a crash: nothing is drained (its children follow, PDEATHSIG)
        server.proc.wait()
    finally:
        server.stop()
    assert (tmp_path / "responses.sqlite3").exists()
    server = start_servers({"s": Server.real(builtin_model_path, *flags)})["s"]
    try:
        client = openai_client(server.url)
        assert client.responses.retrieve(stored.id).output_text == stored.output_text
        failed = client.responses.retrieve(running.id)
        assert failed.status == "failed" and "not resumed" in failed.error.message
        events = list(client.responses.retrieve(running.id, stream=True))
        assert [e.type for e in events] == ["response.failed"]
    finally:
        server.stop()
