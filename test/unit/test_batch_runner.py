"""The Batch API's runner and pieces without a server: the bound on lines in flight, a refused
(503) line tried again, a stop that leaves unfinished lines for the next start (which runs only
those), expiry, the batch priority on the requests, and the input file's validation."""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any

import httpx
import pytest

from radixserve.entrypoints.batch.jsonl import parse_batch_file
from radixserve.entrypoints.batch.lines import BATCH_PRIORITY, LineOutcome, LineRunner
from radixserve.entrypoints.batch.multipart import parse_form
from radixserve.entrypoints.batch.protocol import BatchObject, BatchRequestCounts
from radixserve.entrypoints.batch.runner import BatchRunner
from radixserve.entrypoints.batch.store import BatchStore
from radixserve.entrypoints.openai.protocol import ChatCompletionResponse, CompletionResponse
from radixserve.managers.errors import RequestAbortedError
from radixserve.managers.input_validation import InvalidRequestError

LINE_USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}


class StubLines:
    """Answers each line with its custom_id's text; `gate` holds lines whose id is not in `free`."""

    def __init__(self, refuse_once: set[str] = frozenset(), free: set[str] | None = None) -> None:
        self.calls: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.refuse_once = set(refuse_once)
        self.free = free
        self.gate = asyncio.Event()

    async def run(self, url: str, body: dict[str, Any]) -> LineOutcome:
        cid = body["prompt"]
        self.calls.append(cid)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.free is not None and cid not in self.free:
                await self.gate.wait()
            await asyncio.sleep(0.01)
            if cid in self.refuse_once:
                self.refuse_once.discard(cid)
                return LineOutcome(503, {"error": {"message": "queue full"}})
            return LineOutcome(200, {"text": cid, "usage": LINE_USAGE})
        finally:
            self.in_flight -= 1


def new_batch(n: int, expires_at: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    now = int(time.time())
    batch = BatchObject(
        id=f"batch_{now}_{n}",
        endpoint="/v1/completions",
        input_file_id="file-x",
        completion_window="24h",
        status="validating",
        created_at=now,
        expires_at=expires_at if expires_at is not None else now + 3600,
        request_counts=BatchRequestCounts(total=n),
    ).model_dump(mode="json")
    requests = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"r{i}"}}
        for i in range(n)
    ]
    return batch, requests


async def until_ended(store: BatchStore, batch_id: str) -> dict[str, Any]:
    for _ in range(2000):
        found = await store.run(store.db.get_batch, batch_id)
        if found["status"] in ("completed", "expired", "cancelled", "failed"):
            return found
        await asyncio.sleep(0.01)
    raise AssertionError("the batch did not end")


async def output(store: BatchStore, file_id: str) -> list[dict[str, Any]]:
    content = await store.run(store.db.file_content, file_id)
    return [json.loads(x) for x in content.decode().splitlines()]


def test_lines_in_flight_are_bounded_and_a_refused_line_runs_again() -> None:
    async def main() -> None:
        store = BatchStore(None)
        lines = StubLines(refuse_once={"r1"})
        runner = BatchRunner(store, lines, max_concurrent=2)  # type: ignore[arg-type]
        await runner.start()
        batch, requests = new_batch(6)
        await store.run(store.db.put_batch, batch, requests)
        runner.launch(batch)
        done = await until_ended(store, batch["id"])
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 6
        assert lines.max_in_flight == 2 and lines.calls.count("r1") == 2
        # The six completed lines' usage, the refused try of r1 not counted.
        assert done["usage"] == {
            "input_tokens": 30,
            "input_tokens_details": {"cached_tokens": 12},
            "output_tokens": 18,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 48,
        }
        assert [o["custom_id"] for o in await output(store, done["output_file_id"])] == [
            f"r{i}" for i in range(6)
        ]
        assert done["error_file_id"] is None
        await runner.close()
        store.close()

    asyncio.run(main())


def test_a_stop_keeps_the_unfinished_lines_and_the_next_start_runs_only_those(tmp_path) -> None:
    batch, requests = new_batch(4)

    async def first() -> list[str]:
        store = BatchStore(str(tmp_path))
        lines = StubLines(free={"r0"})  # r1.. wait until the stop
        runner = BatchRunner(store, lines, max_concurrent=2)  # type: ignore[arg-type]
        await runner.start()
        await store.run(store.db.put_batch, batch, requests)
        runner.launch(batch)
        while runner.live[batch["id"]]["request_counts"]["completed"] < 1:
            await asyncio.sleep(0.01)
        await runner.close()  # the server stops
        stored = await store.run(store.db.get_batch, batch["id"])
        assert stored["status"] == "in_progress" and stored["request_counts"]["completed"] == 1
        pending = [req["custom_id"] for _, req in await store.run(store.db.pending_lines, batch["id"])]
        store.close()
        return pending

    async def second() -> tuple[StubLines, dict[str, Any], list[dict[str, Any]]]:
        store = BatchStore(str(tmp_path))
        lines = StubLines()
        runner = BatchRunner(store, lines, max_concurrent=2)  # type: ignore[arg-type]
        await runner.start()  # resumes
        done = await until_ended(store, batch["id"])
        outputs = await output(store, done["output_file_id"])
        await runner.close()
        store.close()
        return lines, done, outputs

    assert asyncio.run(first()) == ["r1", "r2", "r3"]
    lines, done, outputs = asyncio.run(second())
    assert sorted(lines.calls) == ["r1", "r2", "r3"]  # r0 was kept, not run again
    assert done["status"] == "completed" and done["request_counts"] == {
        "total": 4,
        "completed": 4,
        "failed": 0,
    }
    assert [o["custom_id"] for o in outputs] == ["r0", "r1", "r2", "r3"]


def test_an_expired_batch_puts_its_unrun_lines_in_the_error_file() -> None:
    async def main() -> None:
        store = BatchStore(None)
        runner = BatchRunner(store, StubLines(), max_concurrent=2)  # type: ignore[arg-type]
        await runner.start()
        batch, requests = new_batch(3, expires_at=int(time.time()) - 1)
        await store.run(store.db.put_batch, batch, requests)
        runner.launch(batch)
        done = await until_ended(store, batch["id"])
        assert done["status"] == "expired" and done["expired_at"] and done["output_file_id"] is None
        assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
        errors = await output(store, done["error_file_id"])
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        store.close()

    asyncio.run(main())


class RecordingHandler:
    def __init__(self, answer: Any, exc: Exception | None = None) -> None:  # noqa: ANN401
        self.priorities: list[int | None] = []
        self.answer, self.exc = answer, exc

    async def create(self, req: Any, request: Any, priority: int | None = None) -> Any:  # noqa: ANN401
        self.priorities.append(priority)
        if self.exc is not None:
            raise self.exc
        return self.answer


def test_lines_run_at_the_batch_priority_and_errors_become_statuses() -> None:
    chat = RecordingHandler(
        ChatCompletionResponse(id="c", model="m", choices=[], usage={"prompt_tokens": 1, "total_tokens": 1})
    )
    completions = RecordingHandler(
        CompletionResponse(id="d", model="m", choices=[], usage={"prompt_tokens": 1, "total_tokens": 1})
    )
    runner = LineRunner(None, chat, completions, ("m",))  # type: ignore[arg-type]
    messages = {"messages": [{"role": "user", "content": "hi"}]}

    async def main() -> list[LineOutcome]:
        outcomes = [
            await runner.run("/v1/chat/completions", messages),
            await runner.run("/v1/completions", {"prompt": "hi"}),
            await runner.run("/v1/completions", {"prompt": "hi", "max_tokens": "3"}),  # strict, as HTTP
        ]
        for exc in (RequestAbortedError("queue full", 503), InvalidRequestError("bad"), RuntimeError("bug")):
            completions.exc = exc
            outcomes.append(await runner.run("/v1/completions", {"prompt": "hi"}))
        return outcomes

    outcomes = asyncio.run(main())
    assert chat.priorities == [BATCH_PRIORITY] and set(completions.priorities) == {BATCH_PRIORITY}
    assert [o.status_code for o in outcomes] == [200, 200, 400, 503, 400, 500]
    assert outcomes[0].body["id"] == "c" and "max_tokens" in outcomes[2].body["error"]["message"]
    assert "bug" not in outcomes[5].body["error"]["message"]  # a 500 names the type only


def test_the_input_file_is_checked_per_line() -> None:
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    assert [x.custom_id for x in parse_batch_file(json.dumps(good).encode() + b"\n\n", True)] == ["a"]
    cases = [
        (b"\xff", "not UTF-8"),
        (json.dumps({**good, "extra": 1}).encode(), "Line 1: extra"),
        (json.dumps({**good, "body": {"stream": True}}).encode(), "Line 1: body.stream"),
        (json.dumps(good).encode(), "use one of /v1/embeddings"),  # an embedding model
    ]
    for content, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            parse_batch_file(content, content != cases[3][0])


def test_a_multipart_upload_is_read_byte_for_byte() -> None:
    data = b'{"a": 1}\r\n{"b": 2}\n\x00\xff--'
    req = httpx.Request(
        "POST", "http://h/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}
    )
    form = parse_form(req.headers["content-type"], req.read())
    assert form["file"].value == data and form["file"].filename == "in.jsonl"
    assert form["purpose"].value == b"batch" and form["purpose"].filename is None
    with pytest.raises(InvalidRequestError):
        parse_form("application/json", b"{}")


class StubEncoder:
    """The TokenizerManager as the embeddings path uses it: encode_items and its model info."""

    served_model_name = "emb"
    embedding_info = {"normalize": False}

    def __init__(self) -> None:
        self.items: list[Any] = []

    async def encode_items(self, items: list[Any], request: Any) -> list[dict[str, Any]]:  # noqa: ANN401
        self.items.extend(items)
        return [
            {"embedding": [1.0, 2.0], "meta_info": {"prompt_tokens": 2, "finish_reason": None}} for _ in items
        ]


def test_an_embeddings_line_runs_at_the_batch_priority() -> None:
    tm = StubEncoder()
    runner = LineRunner(tm, None, None, ("emb",))  # type: ignore[arg-type]
    outcome = asyncio.run(runner.run("/v1/embeddings", {"input": ["a", "b"], "encoding_format": "float"}))
    assert outcome.status_code == 200, outcome.body
    assert [d["embedding"] for d in outcome.body["data"]] == [[1.0, 2.0], [1.0, 2.0]]
    assert outcome.body["usage"]["prompt_tokens"] == 4 and outcome.body["model"] == "emb"
    assert [item.priority for item in tm.items] == [BATCH_PRIORITY, BATCH_PRIORITY]
    assert asyncio.run(runner.run("/v1/embeddings", {"input": "a", "model": "other"})).status_code == 404
