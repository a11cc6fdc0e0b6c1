"""The Responses layer without a server: request validation (unknown and unhonourable fields are
400s naming them), the translation onto a chat request, chat deltas -> Responses events and output
items (reasoning items need a reasoning model, so they are checked here), the SQLite store (chains,
restart marks running responses failed) and the input_items pages."""

from __future__ import annotations

import json
import sqlite3

import pytest
from pydantic import ValidationError

from radixserve.entrypoints.openai.protocol import DeltaMessage, FunctionCall, NamedToolChoice, ToolCall
from radixserve.entrypoints.responses.events import OutputEvents
from radixserve.entrypoints.responses.protocol import ResponsesRequest
from radixserve.entrypoints.responses.routes import page
from radixserve.entrypoints.responses.store import DB_NAME, INTERRUPTED, SqliteResponses
from radixserve.entrypoints.responses.translate import input_items, parse_items, to_chat_request
from radixserve.managers.input_validation import InvalidRequestError


def request(**fields: object) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"model": "m", **fields}), strict=True)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"input": "hi", "frequency_penalty": 1.0}, "frequency_penalty"),
        ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "background": True, "store": False}, "background"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}, "verbosity": "low"}}, "verbosity"),
    ],
)
def test_unknown_and_unhonourable_fields_are_refused_by_name(fields: dict, named: str) -> None:
    with pytest.raises(ValidationError) as info:
        request(**fields)
    assert named in str(info.value)


def test_items_become_chat_messages_with_tool_calls_and_results() -> None:
    req = request(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "sun"}],
            },
            {"role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]},
        ],
        tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "w"},
        parallel_tool_calls=False,
        max_output_tokens=7,
        temperature=0.0,
    )
    chat = to_chat_request(req, [], reasoning_parser=None)
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Weather in Paris and Rome?"),
        ("assistant", "Checking."),
        ("tool", "rain"),
        ("tool", "sun"),
        ("developer", "Answer now."),
    ]
    calls = chat.messages[2].tool_calls or []
    assert [(c.id, c.function.arguments) for c in calls] == [
        ("c1", '{"city": "Paris"}'),
        ("c2", '{"city": "Rome"}'),
    ]
    assert [m.tool_call_id for m in chat.messages[3:5]] == ["c1", "c2"]
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function == {"name": "w"}
    assert chat.parallel_tool_calls is False and chat.max_tokens == 7 and chat.temperature == 0.0


def test_history_comes_first_and_instructions_are_not_carried_over() -> None:
    first = request(input="Hi", instructions="Old rules.")
    stored = [
        *input_items(first),
        {
            "type": "message",
            "id": "msg_a",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}],
        },
    ]
    assert all(item["id"] for item in stored)
    chat = to_chat_request(request(input="Bye"), parse_items(stored), reasoning_parser=None)
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Bye"),
    ]


def test_text_format_becomes_structured_output_and_reasoning_needs_a_parser() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    chat = to_chat_request(request(input="x", text={"format": fmt}), [], None)
    assert chat.response_format is not None and chat.response_format.json_schema == {
        "name": "thing",
        "schema": schema,
    }
    chat = to_chat_request(request(input="x", text={"format": {"type": "json_object"}}), [], None)
    assert chat.response_format is not None and chat.response_format.type == "json_object"
    with pytest.raises(InvalidRequestError, match="text.format.schema"):
        to_chat_request(request(input="x", text={"format": {"type": "json_schema", "name": "n"}}), [], None)
    with pytest.raises(InvalidRequestError, match="reasoning"):
        to_chat_request(request(input="x", reasoning={"effort": "low"}), [], None)
    assert to_chat_request(request(input="x", reasoning={"effort": "low"}), [], "qwen3").separate_reasoning


def test_deltas_become_items_and_events_in_order() -> None:
    out = OutputEvents()
    events = out.feed(DeltaMessage(reasoning_content="Let me think."))
    events += out.feed(DeltaMessage(content="Sure"))
    events += out.feed(DeltaMessage(content=", calling."))
    call = ToolCall(index=0, id="call_1", function=FunctionCall(name="w", arguments='{"city": '))
    events += out.feed(DeltaMessage(tool_calls=[call]))
    events += out.feed(
        DeltaMessage(tool_calls=[ToolCall(index=0, type=None, function=FunctionCall(arguments='"Paris"}'))])
    )
    events += out.finish()
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    reasoning, message, function_call = out.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "Let me think."}
    ]
    assert message["content"][0]["text"] == "Sure, calling." and message["status"] == "completed"
    assert function_call["call_id"] == "call_1" and function_call["arguments"] == '{"city": "Paris"}'
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert len({reasoning["id"], message["id"], function_call["id"]}) == 3


def test_a_cut_answer_closes_its_item_incomplete() -> None:
    out = OutputEvents()
    out.feed(DeltaMessage(content="Once upon"))
    done = out.finish("incomplete")
    assert done[-1]["item"]["status"] == "incomplete" and done[0]["text"] == "Once upon"
    assert out.finish() == []


def response(rid: str, previous: str | None = None, status: str = "completed", text: str = "ok") -> dict:
    item = {
        "type": "message",
        "id": f"msg_{rid}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    return {"id": rid, "status": status, "previous_response_id": previous, "output": [item]}


def user_item(rid: str, text: str) -> list[dict]:
    return [{"type": "message", "id": f"in_{rid}", "role": "user", "content": text}]


def test_store_chains_deletes_and_fails_what_was_running_at_a_restart(tmp_path) -> None:
    db = SqliteResponses(str(tmp_path))
    db.put(response("r1", text="A"), user_item("r1", "Q1"))
    db.put(response("r2", "r1", text="B"), user_item("r2", "Q2"))
    db.put(response("r3", status="in_progress"), user_item("r3", "Q3"))
    db.update({**response("r1", text="A"), "status": "completed"}, events=[{"type": "response.completed"}])
    history = db.history("r2")
    assert [
        (i["role"], i["content"] if i["role"] == "user" else i["content"][0]["text"]) for i in history
    ] == [("user", "Q1"), ("assistant", "A"), ("user", "Q2"), ("assistant", "B")]
    assert db.events("r1") == [{"type": "response.completed"}] and db.events("r2") is None
    assert db.delete("r1") and not db.delete("r1") and db.get("r1") is None
    assert db.history("r2") is None  # a broken chain is not half-continued
    db.close()
    mode = sqlite3.connect(tmp_path / DB_NAME).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    reopened = SqliteResponses(str(tmp_path))
    assert reopened.get("r2")["status"] == "completed"
    failed = reopened.get("r3")
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "server_error",
        "message": INTERRUPTED,
    }
    assert reopened.input_items("r3") == user_item("r3", "Q3")
    reopened.close()


def test_store_keeps_big_integers_and_lone_surrogates() -> None:
    db = SqliteResponses(None)  # in memory: the default without --storage-dir
    odd = {**response("r"), "tools": [{"parameters": {"maximum": 2**70}}], "metadata": {"k": "\udafd"}}
    db.put(odd, [])
    assert db.get("r") == odd


def test_input_item_pages_follow_openai_cursors() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    first = page(items, None, 2, "asc")
    assert [i["id"] for i in first.data] == ["i0", "i1"] and first.has_more and first.last_id == "i1"
    last = page(items, "i3", 2, "asc")
    assert [i["id"] for i in last.data] == ["i4"] and not last.has_more
    assert [i["id"] for i in page(items, None, 20, "desc").data] == ["i4", "i3", "i2", "i1", "i0"]
    with pytest.raises(ValueError, match="after"):
        page(items, "nope", 2, "asc")


def test_input_image_becomes_a_chat_image_url_part() -> None:
    parts = [
        {"type": "input_text", "text": "What is "},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
        {"type": "input_text", "text": "?"},
    ]
    chat = to_chat_request(request(input=[{"role": "user", "content": parts}]), [], None)
    content = chat.messages[0].content
    assert [p.type for p in content] == ["text", "image_url", "text"]
    assert content[1].image_url.url == "data:image/png;base64,AAAA" and content[1].image_url.detail == "low"
    assert chat.messages[0].text() == "What is ?"
    assert chat.messages[0].image_urls() == ["data:image/png;base64,AAAA"]
