"""The HTTP server's hardening (issues 22 and 23), over ZMQ with the fake scheduler: the Host and
Content-Type rules, strict request types and limits, refusals before a stream starts, tokenizing
off the event loop, one log line per disconnect, and SSE events that match /openapi.json."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fake_scheduler import write_tiny_tokenizer  # noqa: E402
from server_helpers import Server, assert_error, sse_events, start_servers, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(300)

JSON = {"Content-Type": "application/json"}
LONG = {"max_new_tokens": 240}  # ~2.4 s at the fake's 10 ms a token
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("hardening")
    tok_dir = str(tmp / "tok")
    write_tiny_tokenizer(tok_dir)
    flags = ("--max-queued-requests", "2", "--allowed-hosts", "good.example", "--log-level", "info")
    srv = Server.fake(tok_dir, *flags, log_path=str(tmp / "server.log"))
    try:
        yield start_servers({"s": srv})["s"]
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def url(server: Server) -> str:
    return server.url


def post(url: str, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, **{"timeout": 30, **kw})


def aborted_rids(url: str) -> list[str]:
    return httpx.get(f"{url}/get_server_info").json()["internal_states"][0]["aborted_rids"]


def idle(url: str) -> None:
    """Nothing left in flight (the fake refuses past 2 requests; later tests need the room)."""
    wait_until(lambda: httpx.post(f"{url}/flush_cache").status_code == 200, 10, "an idle server")


# ----------------------------------------------------------------------------- cross-site requests
def test_host_header_must_name_the_server(url: str) -> None:
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends `Host: evil.example`."""
    port = url.rsplit(":", 1)[1]
    err = assert_error(httpx.get(f"{url}/get_model_info", headers={"Host": f"evil.example:{port}"}), 400)
    assert "--allowed-hosts" in err["message"]
    assert_error(post(url, "/abort_request", {"abort_all": True}, headers={"Host": "evil.example"}), 400)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "GOOD.example"):
        assert httpx.get(f"{url}/get_model_info", headers={"Host": host}).status_code == 200, host


def test_cross_site_abort_and_flush_are_refused(url: str) -> None:
    """What a page on another site can send without a preflight does nothing."""
    idle(url)
    result: list[dict] = []
    body = {"text": "Hi", "rid": "victim", "sampling_params": {"max_new_tokens": 60}}
    thread = threading.Thread(target=lambda: result.append(post(url, "/generate", body).json()))
    thread.start()
    time.sleep(0.2)
    plain = {"Content-Type": "text/plain"}
    assert_error(httpx.post(f"{url}/abort_request", content=b'{"abort_all": true}', headers=plain), 415)
    assert_error(httpx.post(f"{url}/abort_request", content=b'{"rid": "victim"}'), 415)  # no type
    thread.join(timeout=30)
    assert result[0]["meta_info"]["finish_reason"]["type"] == "length"  # ran to the end
    resp = httpx.get(f"{url}/flush_cache")
    assert_error(resp, 405)
    assert resp.headers["allow"] == "POST"
    origin = {"Origin": "https://evil.example"}
    assert_error(httpx.post(f"{url}/flush_cache", headers=origin), 415)
    assert_error(httpx.post(f"{url}/flush_cache", content=b"x", headers=plain), 415)
    resp = httpx.post(f"{url}/flush_cache")  # curl -X POST, requests.post(url): no body, no Origin
    assert resp.status_code == 200 and resp.text == "Cache flushed."
    assert resp.headers["content-type"].startswith("text/plain")
    assert httpx.post(f"{url}/flush_cache", json={}).status_code == 200


# ----------------------------------------------------------------------------- strict types, limits
NATIVE = "/generate"
CMPL = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        # silent type coercion (issue 23)
        (NATIVE, b'{"text": "a", "stream": "yes"}', "stream"),
        (NATIVE, b'{"text": "a", "return_logprob": "true"}', "return_logprob"),
        (NATIVE, b'{"text": "a", "return_logprob": true, "top_logprobs_num": "2"}', "top_logprobs_num"),
        (CMPL, b'{"prompt": "a", "max_tokens": "10"}', "max_tokens"),
        (CMPL, b'{"prompt": "a", "stream": "yes"}', "stream"),
        (CMPL, b'{"prompt": "a", "echo": 1}', "echo"),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": "10"}', "max_tokens"),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "a"}], "logprobs": "yes"}', "logprobs"),
        ("/abort_request", b'{"abort_all": "yes"}', "abort_all"),
        ("/v1/tokenize", b'{"prompt": "a", "add_special_tokens": "no"}', "add_special_tokens"),
        ("/v1/detokenize", b'{"tokens": ["1"]}', "tokens"),
        # NaN / Infinity (the JSON parser accepts the literals) and a tiny repetition penalty
        (NATIVE, b'{"text": "a", "sampling_params": {"temperature": NaN}}', "temperature must be a finite"),
        (
            NATIVE,
            b'{"text": "a", "sampling_params": {"temperature": Infinity}}',
            "temperature must be a finite",
        ),
        (NATIVE, b'{"text": "a", "sampling_params": {"top_p": -Infinity}}', "top_p must be a finite"),
        (NATIVE, b'{"text": "a", "sampling_params": {"repetition_penalty": 1e-30}}', "repetition_penalty"),
        (CMPL, b'{"prompt": "a", "temperature": NaN}', "finite"),
        (CMPL, b'{"prompt": "a", "repetition_penalty": 1e-30}', "repetition_penalty"),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "a"}], "top_p": Infinity}', "finite"),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "a"}], "min_p": NaN}', "finite"),
        (
            CHAT_PATH,
            b'{"messages": [{"role": "user", "content": "a"}], "repetition_penalty": 1e-30}',
            "repetition",
        ),
        # unbounded work per request (issue 22)
        (NATIVE, b'{"text": "a", "sampling_params": {"n": 1000}}', "n must be in [1, 128]"),
        (NATIVE, b'{"text": "a", "return_logprob": true, "top_logprobs_num": 100000}', "top_logprobs_num"),
        (NATIVE, b'{"text": "a", "rid": "' + b"r" * 1_000_000 + b'"}', "at most 256 characters"),
        (CMPL, b'{"prompt": "a", "n": 129}', "n"),
        (CMPL, b'{"prompt": "a", "rid": "' + b"r" * 300 + b'"}', "rid"),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "a"}], "n": 1000}', "n"),
        # nonsense accepted (issue 23)
        (NATIVE, b'{"text": "a", "return_logprob": true, "logprob_start_len": -7}', "logprob_start_len"),
        (
            NATIVE,
            b'{"text": "ab", "return_logprob": true, "logprob_start_len": 1000000}',
            "logprob_start_len",
        ),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}', "top_logprobs"),
        (
            NATIVE,
            b'{"text": "a", "sampling_params": {"json_schema": "{\\"$ref\\": \\"file:///etc/passwd\\"}"}}',
            "$ref",
        ),
        (
            CHAT_PATH,
            b'{"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema", '
            b'"json_schema": {"name": "x", "schema": {"$ref": "http://example.com/s.json"}}}}',
            "$ref",
        ),
    ],
)
def test_bad_requests_are_400(url: str, path: str, body: bytes, needle: str) -> None:
    err = assert_error(httpx.post(f"{url}{path}", content=body, headers=JSON, timeout=30), 400)
    assert needle in err["message"], err


def test_logprob_start_len_inside_the_prompt_is_accepted(url: str) -> None:
    ids = [67, 68, 69, 70]
    for start in (-1, 0, 3):
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start}
        out = post(url, "/generate", {**body, "sampling_params": {"max_new_tokens": 1}}).json()
        assert out["meta_info"]["finish_reason"]["type"] == "length", (start, out)
    # SGLang ignores logprob_start_len without return_logprob; so do we.
    body = {"input_ids": ids, "logprob_start_len": 10, "sampling_params": {"max_new_tokens": 1}}
    assert post(url, "/generate", body).status_code == 200


def test_tokenize_and_detokenize_check_the_model(url: str) -> None:
    assert post(url, "/v1/tokenize", {"model": "default", "prompt": "Hi"}).status_code == 200
    err = assert_error(post(url, "/v1/tokenize", {"model": "nope", "prompt": "Hi"}), 404)
    assert err["code"] == "model_not_found"
    assert (
        assert_error(post(url, "/v1/detokenize", {"model": "nope", "tokens": [67]}), 404)["code"]
        == "model_not_found"
    )


# ----------------------------------------------------------------------------- refusals before a stream
def test_streamed_request_refused_for_a_full_queue_is_503(url: str) -> None:
    """As a non-streaming call does: the status comes before any event (issue 23)."""
    idle(url)
    long = {"text": "Hi", "stream": True, "sampling_params": LONG}
    with httpx.Client(timeout=30) as client:
        streams = [client.stream("POST", f"{url}/generate", json=long) for _ in range(2)]
        lines = [s.__enter__().iter_lines() for s in streams]  # kept: a dropped iterator disconnects
        try:
            for it in lines:
                next(it)  # both admitted: the queue (--max-queued-requests 2) is full
            body = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 4}}
            err = assert_error(client.post(f"{url}/generate", json=body), 503)
            assert "queue is full" in err["message"]
            cmpl = {"prompt": "Hi", "max_tokens": 4, "stream": True}
            assert_error(client.post(f"{url}/v1/completions", json=cmpl), 503)
            chat = {"messages": CHAT, "max_tokens": 4, "stream": True}
            assert_error(client.post(f"{url}/v1/chat/completions", json=chat), 503)
            with pytest.raises(openai.APIStatusError) as exc:
                oai = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                oai.chat.completions.create(model="default", messages=CHAT, max_tokens=4, stream=True)
            assert exc.value.status_code == 503
        finally:
            for s in streams:
                s.__exit__(None, None, None)


# ----------------------------------------------------------------------------- tokenizing off the loop
def test_health_stays_fast_while_huge_prompts_tokenize(url: str) -> None:
    """Four ~2 MB prompts tokenize for seconds (then fail: longer than the fake's 256-token context);
    /health keeps answering meanwhile. Before, it waited for each tokenization in turn."""
    idle(url)
    prompt = ("Hello world, the quick brown fox jumps over the lazy dog. " * 35000)[:2_000_000]
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
    start = time.monotonic()
    assert (
        "longer than the model's context length" in assert_error(post(url, "/generate", body), 400)["message"]
    )
    one = time.monotonic() - start
    latencies: list[float] = []
    statuses: list[int] = []
    done = threading.Event()

    def big() -> None:
        statuses.append(post(url, "/generate", body, timeout=120).status_code)

    def probe() -> None:
        while not done.is_set():
            t = time.monotonic()
            statuses.append(httpx.get(f"{url}/health", timeout=60).status_code - 200 + 400)
            latencies.append(time.monotonic() - t)
            time.sleep(0.02)

    threads = [threading.Thread(target=big) for _ in range(4)]
    prober = threading.Thread(target=probe)
    prober.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    prober.join(timeout=60)
    assert set(statuses) == {400}, statuses  # the big ones 400, every /health 200 (+200)
    # Generous: a tokenization on the loop would hold /health for about `one` (~2.5 s here).
    assert len(latencies) > 5 and max(latencies) < max(one / 2, 0.5), (one, sorted(latencies)[-5:])


def test_body_over_the_limit_is_413_before_it_is_read(url: str) -> None:
    limit = httpx.get(f"{url}/get_server_info").json()["max_request_body_bytes"]
    assert limit == 32 * 1024 * 1024  # the documented default
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/tokenize HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {limit + 1}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode())  # the headers only: the answer must not wait for 32 MiB
        answer = b""
        while not answer.endswith(b"}"):  # the JSON error envelope ends the answer
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    status, _, body = answer.decode().partition("\r\n\r\n")
    assert status.startswith("HTTP/1.1 413"), answer
    assert "--max-request-body-bytes" in json.loads(body)["error"]["message"]


# ----------------------------------------------------------------------------- disconnects
def test_each_disconnect_logs_one_line_and_no_traceback(server: Server, url: str) -> None:
    idle(url)
    body = {"text": "Hi", "rid": "gone-plain", "sampling_params": LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=body, timeout=0.5)
    body = {"text": "Hi", "rid": "gone-stream", "stream": True, "sampling_params": LONG}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
        next(resp.iter_lines())
    wait_until(lambda: {"gone-plain", "gone-stream"} <= set(aborted_rids(url)), 5, "both aborted")
    time.sleep(0.5)  # let the log lines land
    assert server.log_path is not None
    with open(server.log_path) as f:
        log = f.read()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    for rid in ("gone-plain", "gone-stream"):
        lines = [line for line in log.splitlines() if "Client disconnected" in line and rid in line]
        assert len(lines) == 1, lines


# ----------------------------------------------------------------------------- the declared SSE schema
def _declared(doc: dict, path: str) -> tuple[jsonschema.Validator, jsonschema.Validator]:
    """Validators of one route's JSON answer and of one of its SSE events, from /openapi.json."""
    ok = doc["paths"][path]["post"]["responses"]["200"]["content"]

    def validator(schema: dict) -> jsonschema.Validator:
        return jsonschema.Draft202012Validator({"components": doc["components"], **schema})

    # One SSE event is {"data": ...}: "[DONE]", or JSON matching `contentSchema`.
    data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
    assert data[0] == {"const": "[DONE]"}
    return validator(ok["application/json"]["schema"]), validator(data[1]["contentSchema"])


def _events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_answers_and_sse_events_match_the_declared_schema(url: str) -> None:
    idle(url)
    doc = httpx.get(f"{url}/openapi.json").json()
    native = {
        "text": "Hello",
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 3, "n": 2},
    }
    cmpl = {"prompt": "Hello", "max_tokens": 3, "echo": True, "stream_options": {"include_usage": True}}
    chat = {
        "messages": CHAT,
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    for path, body in ((NATIVE, native), (CMPL, cmpl), (CHAT_PATH, chat)):
        answer, event = _declared(doc, path)
        answer.validate(post(url, path, body).json())
        events = _events(url, path, body)
        assert len(events) > 2
        for e in events:
            event.validate(e)
    # A refused item of a started stream arrives in-band as an error event: declared too.
    idle(url)
    events = _events(url, CMPL, {"prompt": ["a", "b", "c"], "max_tokens": 3})
    assert "error" in events[-1] and events[-1]["error"]["code"] == 503
    for e in events:
        _declared(doc, CMPL)[1].validate(e)
