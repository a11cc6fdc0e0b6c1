"""The Anthropic and Ollama translation layers without a server: requests -> chat requests,
chat deltas -> Anthropic's content-block events (thinking blocks need a reasoning model, so
they are checked here), Ollama options -> sampling fields, and the error dialects."""

from __future__ import annotations

import json

import orjson
import pytest

from radixserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from radixserve.entrypoints.anthropic.stream import BlockEvents
from radixserve.entrypoints.anthropic.translate import content_blocks, stop_reason, to_chat_request
from radixserve.entrypoints.error_dialects import ErrorDialectMiddleware, anthropic_error, ollama_error
from radixserve.entrypoints.ollama.options import sampling_fields
from radixserve.entrypoints.openai.chat_tools import ChatPlan, split_output
from radixserve.entrypoints.openai.protocol import DeltaMessage, FunctionCall, ToolCall
from radixserve.managers.input_validation import InvalidRequestError


def messages_request(**fields: object) -> MessagesRequest:
    return MessagesRequest.model_validate_json(
        json.dumps({"model": "m", "max_tokens": 8, **fields}), strict=True
    )


def test_tool_use_and_tool_result_become_chat_tool_calls_and_tool_messages() -> None:
    req = messages_request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "rain"}],
                    },
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                    {"type": "text", "text": "So?"},
                ],
            },
        ],
        tools=[{"name": "w", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        temperature=0.5,
    )
    chat = to_chat_request(req, reasoning_parser=None)
    roles = [(m.role, m.text()) for m in chat.messages]
    assert roles == [
        ("system", "Be brief.\nUse tools."),
        ("user", "Weather?"),
        ("assistant", "Checking."),  # the earlier turn's thinking is not sent back
        ("tool", "rain"),
        ("tool", "Error: boom"),
        ("user", "So?"),
    ]
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1",
        "w",
        {"city": "Paris"},
    )
    assert [m.tool_call_id for m in chat.messages[3:5]] == ["toolu_1", "toolu_2"]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert (chat.stop, chat.temperature, chat.max_tokens) == (["END"], 0.5, 8)
    assert chat.tools[0].function.parameters == {"type": "object"}


def test_thinking_needs_a_reasoning_parser_and_disabled_keeps_reasoning_inline() -> None:
    req = CountTokensRequest(
        model="m", messages=[{"role": "user", "content": "x"}], thinking={"type": "enabled"}
    )
    with pytest.raises(InvalidRequestError, match="reasoning-parser"):
        to_chat_request(req, reasoning_parser=None)
    assert to_chat_request(req, reasoning_parser="qwen3").separate_reasoning is True
    req.thinking.type = "disabled"
    assert to_chat_request(req, reasoning_parser="qwen3").separate_reasoning is False


def test_a_user_image_is_refused_with_its_place() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
    req = messages_request(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image]}])
    with pytest.raises(InvalidRequestError, match=r"messages\.0\.content\.1: image"):
        to_chat_request(req, reasoning_parser=None)


def test_block_events_open_one_block_at_a_time() -> None:
    blocks = BlockEvents()
    events = blocks.feed(DeltaMessage(reasoning_content="Let me think"))
    events += blocks.feed(DeltaMessage(reasoning_content=" more", content="Hi"))
    events += blocks.feed(
        DeltaMessage(
            tool_calls=[ToolCall(index=0, id="call_ab", function=FunctionCall(name="w", arguments=""))]
        )
    )
    events += blocks.feed(
        DeltaMessage(tool_calls=[ToolCall(index=0, type=None, function=FunctionCall(arguments='{"a": 1}'))])
    )
    events += blocks.finish()
    shape = [
        (e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
        for e in events
    ]
    assert shape == [
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
    ]
    assert events[7]["content_block"]["id"] == "toolu_ab"
    assert events[8]["delta"]["partial_json"] == '{"a": 1}'
    assert blocks.finish() == []


def test_whole_output_blocks_and_stop_reasons() -> None:
    plan = ChatPlan(input_ids=[], tool_format="hermes", reasoning_parser="qwen3")
    text = (
        '<think>plan</think>\n\nSure.<tool_call>\n{"name": "w", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    blocks = content_blocks(split_output(text, plan))
    assert [b.type for b in blocks] == ["thinking", "text", "tool_use"]
    assert (blocks[0].thinking, blocks[1].text, blocks[2].input) == ("plan", "Sure.", {"city": "Rome"})

    def out(kind: str, matched: object = None) -> dict:
        return {"meta_info": {"finish_reason": {"type": kind, "matched": matched}}}

    assert stop_reason(out("stop", "END"), has_tool_calls=False) == ("stop_sequence", "END")
    assert stop_reason(out("stop", 2), has_tool_calls=False) == ("end_turn", None)
    assert stop_reason(out("stop", 2), has_tool_calls=True) == ("tool_use", None)
    assert stop_reason(out("length"), has_tool_calls=True) == ("max_tokens", None)


def test_ollama_options() -> None:
    fields = sampling_fields(
        {
            "num_predict": 5,
            "repeat_penalty": 1.1,
            "top_k": 3,
            "stop": ["x"],
            "num_ctx": 99,
            "new_thing": 1,
            "seed": None,
        }
    )
    assert fields == {"max_tokens": 5, "repetition_penalty": 1.1, "top_k": 3, "stop": ["x"]}
    assert sampling_fields({"num_predict": -1})["max_tokens"] is None
    assert sampling_fields({"mirostat": 0, "tfs_z": 1.0, "typical_p": 1}) == {"max_tokens": None}
    for bad in (
        {"typical_p": 0.5},
        {"num_predict": -3},
        {"top_k": 1.5},
        {"temperature": True},
        {"stop": "x"},
    ):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            sampling_fields(bad)


async def _through_middleware(path: str, status: int, body: bytes) -> tuple[int, dict]:
    async def app(scope: dict, receive: object, send: object) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await ErrorDialectMiddleware(app)({"type": "http", "path": path}, None, send)
    headers = dict(sent[0]["headers"])
    assert int(headers[b"content-length"]) == len(sent[1]["body"])
    return sent[0]["status"], orjson.loads(sent[1]["body"])


@pytest.mark.parametrize(
    ("path", "status", "expected"),
    [
        ("/v1/messages", 400, anthropic_error(400, "bad")),
        ("/v1/messages/count_tokens", 503, anthropic_error(503, "bad")),
        ("/api/chat", 404, ollama_error(404, "bad")),
        ("/v1/chat/completions", 400, {"error": {"message": "bad", "type": "invalid_request_error"}}),
    ],
)
def test_error_dialects(path: str, status: int, expected: dict) -> None:
    import asyncio

    envelope = orjson.dumps({"error": {"message": "bad", "type": "invalid_request_error"}})
    assert asyncio.run(_through_middleware(path, status, envelope)) == (status, expected)
    assert anthropic_error(503, "x")["error"]["type"] == "overloaded_error"
    assert anthropic_error(500, "x")["error"]["type"] == "api_error"


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ([(b"x-api-key", b"k3y")], 200),  # Anthropic's clients
        ([(b"authorization", b"Bearer k3y")], 200),
        ([(b"x-api-key", b"K3Y")], 401),
        ([(b"x-api-key", b"")], 401),
        ([], 401),
    ],
)
def test_the_api_key_guard_takes_x_api_key(headers: list, status: int) -> None:
    import asyncio

    from radixserve.entrypoints.http_guards import GuardMiddleware

    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/messages", "headers": headers}
    asyncio.run(GuardMiddleware(app, allowed_hosts=None, api_key="k3y")(scope, None, send))
    assert sent[0]["status"] == status


def test_ollama_final_answer_carries_parsed_tool_calls() -> None:
    from radixserve.entrypoints.ollama.protocol import Timings
    from radixserve.entrypoints.ollama.serving import Final

    plan = ChatPlan(input_ids=[], tool_format="hermes")
    text = 'Ok.<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>'
    timings = Timings(
        total_duration=3, prompt_eval_count=1, prompt_eval_duration=1, eval_count=1, eval_duration=2
    )
    final = Final(split_output(text, plan), "stop", timings)
    assert final.parts.content == "Ok."
    assert [c.model_dump() for c in final.tool_calls()] == [
        {"function": {"name": "w", "arguments": {"city": "Oslo"}}}
    ]
    assert Final(split_output("plain", plan), "stop", timings).tool_calls() is None


def test_ollama_requests_translate_to_chat_and_completions() -> None:
    from radixserve.entrypoints.ollama.protocol import ChatRequest, GenerateRequest
    from radixserve.entrypoints.ollama.translate import (
        chat_request,
        generate_chat_request,
        raw_completion_request,
    )

    req = ChatRequest.model_validate_json(
        json.dumps(
            {
                "model": "m:latest",
                "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": {"c": 1}}}]},
                    {"role": "tool", "content": "sun", "tool_name": "w"},
                ],
                "format": "json",
                "options": {"num_predict": 7},
            }
        ),
        strict=True,
    )
    chat = chat_request(req, reasoning_parser=None)
    assert chat.model == "m" and chat.max_tokens == 7 and chat.json_schema == '{"type": "object"}'
    assert json.loads(chat.messages[1].tool_calls[0].function.arguments) == {"c": 1}
    assert (chat.messages[2].role, chat.messages[2].name) == ("tool", "w")
    assert chat.separate_reasoning is True
    with pytest.raises(InvalidRequestError, match="think"):
        chat_request(req.model_copy(update={"think": True}), reasoning_parser=None)
    assert (
        chat_request(req.model_copy(update={"think": False}), reasoning_parser="qwen3").separate_reasoning
        is False
    )
    gen = GenerateRequest(model="m", prompt="Hi", system="Be kind.")
    assert [m.role for m in generate_chat_request(gen, None).messages] == ["system", "user"]
    raw = raw_completion_request(GenerateRequest(model="m", prompt="Hi", raw=True), [1, 2, 3], context_len=10)
    assert raw.prompt == [1, 2, 3] and raw.max_tokens == 7  # no num_predict: the rest of the context
    with pytest.raises(InvalidRequestError, match="system"):
        raw_completion_request(gen.model_copy(update={"raw": True}), [1], context_len=10)


def test_a_draining_server_refuses_in_each_familys_shape() -> None:
    """DrainMiddleware sits outside the app's middleware (launch_server adds it last)."""
    import asyncio

    from radixserve.entrypoints.drain import SHUTTING_DOWN, Drain, DrainMiddleware

    drain = Drain(30, lambda msg: None, lambda: None)
    drain.draining = True

    async def refused(path: str) -> tuple[int, dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await DrainMiddleware(None, drain)({"type": "http", "path": path, "headers": []}, None, send)  # type: ignore[arg-type]
        return sent[0]["status"], orjson.loads(sent[1]["body"])

    assert asyncio.run(refused("/v1/messages")) == (503, anthropic_error(503, SHUTTING_DOWN))
    assert asyncio.run(refused("/api/chat")) == (503, ollama_error(503, SHUTTING_DOWN))
    assert asyncio.run(refused("/v1/chat/completions"))[1]["error"]["message"] == SHUTTING_DOWN
