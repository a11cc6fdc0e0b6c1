"""OpenAI's Files and Batch APIs through the unchanged `openai` client, on the shared built-in-
model server (greedy, short answers): upload, create, poll to completed, output lines equal to
what the same requests give on the normal route, a failing line in the error file, cancel,
errors (400 naming the line or field, 404, never 500), and a restart in the middle of a batch
(tiny model, --storage-dir): the lines done before it are kept, the others run after it."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import sys
from typing import Any

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import Server, start_servers, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ENDED = ("completed", "failed", "cancelled", "expired")


def openai_client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(client_apis_url: str) -> OpenAI:
    return openai_client(client_apis_url)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(line) for line in lines).encode()


def upload(client: OpenAI, lines: list[dict[str, Any]] | bytes, purpose: str = "batch") -> Any:  # noqa: ANN401
    content = lines if isinstance(lines, bytes) else jsonl(lines)
    return client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose=purpose)  # type: ignore[arg-type]


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_body(content: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:  # noqa: ANN401
    return {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, **extra}  # fmt: skip


def wait_ended(client: OpenAI, batch_id: str, timeout: float = 240) -> Any:  # noqa: ANN401
    return wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in ENDED and b, timeout, "batch end"
    )


def file_lines(client: OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_answers_as_the_route_does(client: OpenAI, client_apis_url: str) -> None:
    questions = ["What is the capital of France?", "Name a colour.", "Say hello."]
    lines = [line(f"q{i}", chat_body(q)) for i, q in enumerate(questions)]
    lines.append(line("bad", chat_body("x", max_tokens=-1)))
    file = upload(client, lines)
    assert (file.purpose, file.filename, file.bytes) == ("batch", "input.jsonl", len(jsonl(lines)))
    assert client.files.retrieve(file.id).id == file.id
    assert client.files.content(file.id).content == jsonl(lines)
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "1"}
    )
    assert batch.status == "validating" and batch.request_counts.total == 4
    done = wait_ended(client, batch.id)
    assert done.status == "completed" and done.metadata == {"run": "1"}
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    outputs = file_lines(client, done.output_file_id)
    assert [o["custom_id"] for o in outputs] == ["q0", "q1", "q2"]
    line_usage = [o["response"]["body"]["usage"] for o in outputs]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in line_usage)
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in line_usage)
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens > 0
    for out, question in zip(outputs, questions):
        assert out["error"] is None and out["response"]["status_code"] == 200
        body = httpx.post(
            f"{client_apis_url}/v1/chat/completions", json=chat_body(question), timeout=120
        ).json()
        got = out["response"]["body"]["choices"][0]["message"]["content"]
        assert got == body["choices"][0]["message"]["content"]
    [error] = file_lines(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "max_tokens" in error["response"]["body"]["error"]["message"]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    listed = client.batches.list(limit=100)
    assert done.id in [b.id for b in listed.data]
    assert file.id in [f.id for f in client.files.list(purpose="batch").data]
    assert client.files.delete(file.id).deleted
    with pytest.raises(NotFoundError):
        client.files.retrieve(file.id)
    assert client.batches.retrieve(done.id).status == "completed"  # the batch does not need its input


def test_cancel_stops_the_batch_and_keeps_what_finished(client: OpenAI) -> None:
    # ignore_eos: each line would take minutes, so the cancel always finds them unfinished.
    lines = [
        line(f"c{i}", chat_body("Tell a long story.", max_tokens=2000, ignore_eos=True)) for i in range(4)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelling_at and cancelled.cancelled_at
    counts = cancelled.request_counts
    assert counts.completed == 0 and counts.failed == counts.total == 4
    errors = file_lines(client, cancelled.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == ["c0", "c1", "c2", "c3"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # an ended batch stays as it is


def test_files_expire_as_the_client_asks(client: OpenAI) -> None:
    """The openai client's expires_after and output_expires_after (the expiry itself, with a fake
    clock: test/unit/test_batch_file_expiry.py)."""
    content = jsonl([line("e", chat_body("hi", max_tokens=1))])
    default = upload(client, content)
    assert default.expires_at == default.created_at + 30 * 24 * 3600
    hour = {"anchor": "created_at", "seconds": 3600}
    short = client.files.create(file=("e.jsonl", io.BytesIO(content)), purpose="batch", expires_after=hour)  # type: ignore[arg-type]
    assert short.expires_at == short.created_at + 3600
    with pytest.raises(BadRequestError, match="expires_after.seconds: 60 is outside"):
        client.files.create(
            file=("e.jsonl", io.BytesIO(content)),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 60},
        )  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="output_expires_after"):
        client.batches.create(input_file_id=short.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 1})  # type: ignore[arg-type]  # fmt: skip
    batch = client.batches.create(
        input_file_id=short.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    done = wait_ended(client, batch.id)
    out = client.files.retrieve(done.output_file_id)
    assert done.status == "completed" and out.expires_at == out.created_at + 7200


@pytest.mark.parametrize(
    ("content", "purpose", "message"),
    [
        (jsonl([line("a", {})]) + b"\n{oops", "batch", "Line 2: not valid JSON"),
        (jsonl([line("a", {}), line("a", {})]), "batch", "Line 2: custom_id 'a' is already used on line 1"),
        (
            jsonl([line("a", {}, url="/v1/embeddings")]),
            "batch",
            "Line 1: url '/v1/embeddings' is not supported",
        ),
        (jsonl([{**line("a", {}), "method": "GET"}]), "batch", "Line 1: method"),
        (jsonl([{**line("a", {}), "body": [1]}]), "batch", "Line 1: body"),
        (jsonl([line("a", {})]), "fine-tune", "purpose: 'fine-tune' is not accepted"),
    ],
)
def test_a_bad_upload_is_a_400_naming_the_line(
    client: OpenAI, content: bytes, purpose: str, message: str
) -> None:
    with pytest.raises(BadRequestError) as err:
        upload(client, content, purpose)
    assert message in err.value.message


def test_batch_errors_are_400_or_404(client: OpenAI, client_apis_url: str) -> None:
    for call in (
        lambda: client.files.retrieve("file-nope"),
        lambda: client.files.content("file-nope"),
        lambda: client.files.delete("file-nope"),
        lambda: client.batches.retrieve("batch_nope"),
        lambda: client.batches.cancel("batch_nope"),
        lambda: client.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(NotFoundError):
            call()
    file = upload(client, [line("a", chat_body("hi"))])
    with pytest.raises(BadRequestError, match="Line 1: url '/v1/chat/completions' differs"):
        client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(BadRequestError, match="endpoint: '/v1/embeddings' is not supported"):
        client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    body = {"input_file_id": file.id, "endpoint": "/v1/chat/completions", "completion_window": "1h"}
    resp = httpx.post(f"{client_apis_url}/v1/batches", json=body, timeout=30)
    assert resp.status_code == 400 and "completion_window" in resp.json()["error"]["message"]
    # A browser page may post a form cross-site: with an Origin the upload is refused.
    form = {"content-type": "multipart/form-data; boundary=b", "origin": "http://page.example"}
    resp = httpx.post(f"{client_apis_url}/v1/files", content=b"--b--\r\n", headers=form, timeout=30)
    assert resp.status_code == 415
    resp = httpx.get(f"{client_apis_url}/v1/batches", params={"after": "batch_nope"}, timeout=30)
    assert resp.status_code == 400


def test_a_restart_resumes_a_batch_from_the_lines_not_done(tiny_llama_path: str, tmp_path) -> None:
    flags = (
        "--max-total-tokens",
        "4096",
        "--storage-dir",
        str(tmp_path),
        "--batch-max-concurrent-requests",
        "1",
    )
    body = {"model": "default", "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
    lines = [line(f"p{i}", {**body, "prompt": f"Item {i}:"}, url="/v1/completions") for i in range(4)]
    server = start_servers({"s": Server.real(tiny_llama_path, *flags)})["s"]
    try:
        client = openai_client(server.url)
        file = upload(client, lines)
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        )
        wait_until(
            lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 120, "a line done"
        )
        server.proc.kill()  # a crash: nothing is drained (its children follow, PDEATHSIG)
        server.proc.wait()
    finally:
        server.stop()
    with sqlite3.connect(tmp_path / "batches.sqlite3") as db:
        rows = db.execute(
            "SELECT result FROM batch_lines WHERE batch_id = ? ORDER BY line", (batch.id,)
        ).fetchall()
    done_before = {json.loads(r[0])["id"] for r in rows if r[0] is not None}
    assert 1 <= len(done_before) < len(lines)  # the crash came in the middle of the batch
    server = start_servers({"s": Server.real(tiny_llama_path, *flags)})["s"]
    try:
        client = openai_client(server.url)
        done = wait_ended(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == len(lines)
        outputs = file_lines(client, done.output_file_id)
        assert [o["custom_id"] for o in outputs] == [x["custom_id"] for x in lines]
        assert done_before <= {o["id"] for o in outputs}  # kept, not run again
        for out, request in zip(outputs, lines):
            answer = httpx.post(f"{server.url}/v1/completions", json=request["body"], timeout=120).json()
            assert out["response"]["body"]["choices"][0]["text"] == answer["choices"][0]["text"]
    finally:
        server.stop()
