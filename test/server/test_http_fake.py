"""The real HTTP server over ZMQ with the fake scheduler (test/server/fake_scheduler.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx
import openai
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server_helpers import FAKE_API_KEY, Server, SharedServers, assert_error, sse_events  # noqa: E402

API_KEY = FAKE_API_KEY
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def servers(fake_servers: SharedServers) -> dict[str, Server]:
    """conftest's shared fake servers ("auth" is test_http_errors_fake.py's too)."""
    return fake_servers.get("main", "auth")


@pytest.fixture(scope="module")
def url(servers: dict[str, Server]) -> str:
    return servers["main"].url


@pytest.fixture(scope="module", params=["main", "process"])
def text_url(request: pytest.FixtureRequest, fake_servers: SharedServers) -> str:
    """Text tests run on both routes of a step's token ids: main's default (on CPU, the tokenizer
    manager decodes them: --detokenizer inline) and the detokenizer process's."""
    return fake_servers.get(request.param)[request.param].url


def detok(url: str, ids: list[int]) -> str:
    return httpx.post(f"{url}/v1/detokenize", json={"tokens": ids}).json()["text"]


# ----------------------------------------------------------------------------- native routes
def test_health_and_info(url: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=10).status_code == 200
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == info["tokenizer_path"]
    assert info["has_image_understanding"] is False  # a text-only model
    server_info = httpx.get(f"{url}/get_server_info").json()
    assert server_info["served_model_name"] == "tiny"
    assert server_info["internal_states"][0]["fake"] is True


def test_generate_single_batch_and_n(url: str) -> None:
    out = httpx.post(
        f"{url}/generate", json={"text": "Hello world", "sampling_params": {"max_new_tokens": 4}}
    ).json()
    assert out["text"] == "Hello worldHello world"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert out["meta_info"]["completion_tokens"] == 4 and len(out["output_ids"]) == 4
    body = {
        "input_ids": [[67, 68], [69]],
        "sampling_params": [{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 3}],
    }
    outs = httpx.post(f"{url}/generate", json=body).json()
    assert [o["output_ids"] for o in outs] == [[67, 68], [67, 68], [69, 69, 69]]
    assert [o["meta_info"]["id"][-2:] for o in outs[:2]] == ["-0", "-1"]


def test_generate_stream_and_stop_strings(text_url: str) -> None:
    body = {
        "text": "Hello world STOP",
        "stream": True,
        "sampling_params": {"max_new_tokens": 40, "stop": ["STOP"]},
    }
    with httpx.stream("POST", f"{text_url}/generate", json=body) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("STOP" not in c["text"] for c in chunks)
    assert chunks[-1]["text"] == "Hello world "
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "STOP"}
    assert sum(c["meta_info"]["finish_reason"] is not None for c in chunks) == 1


def test_stop_token_and_no_stop_trim(text_url: str) -> None:
    params = {"max_new_tokens": 10, "stop_token_ids": [69], "skip_special_tokens": True}
    out = httpx.post(
        f"{text_url}/generate", json={"input_ids": [67, 68, 69], "sampling_params": params}
    ).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 69}
    assert out["text"] == detok(text_url, [67, 68])
    params = {"max_new_tokens": 10, "stop": "wor", "no_stop_trim": True}
    out = httpx.post(f"{text_url}/generate", json={"text": "Hello world", "sampling_params": params}).json()
    assert out["text"] == "Hello wor"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_have_one_authority(text_url: str, stream: bool) -> None:
    """The scheduler ends the request at the stop string a token completes (here "o" once
    min_new_tokens allows it) and the detokenizer cuts the text there: the same text streamed or
    whole, one finish, no AbortReq back to the scheduler. Had the detokenizer matched too, the whole
    text would end at the first "o"; had neither, the output would run to max_new_tokens."""
    ids = httpx.post(f"{text_url}/v1/tokenize", json={"prompt": "Hello world, the fox"}).json()["tokens"]
    first_o = next(k for k in range(len(ids)) if "o" in detok(text_url, ids[: k + 1]))
    rid = f"one-authority-{stream}"
    params = {"max_new_tokens": 40, "stop": ["o"], "min_new_tokens": first_o + 2}
    body = {"input_ids": ids, "stream": stream, "rid": rid, "sampling_params": params}
    if stream:
        with httpx.stream("POST", f"{text_url}/generate", json=body) as resp:
            chunks = [json.loads(e) for e in sse_events(resp)[:-1]]
        text, last = chunks[-1]["text"], chunks[-1]  # native streams carry the text so far
        assert sum(c["meta_info"]["finish_reason"] is not None for c in chunks) == 1
    else:
        last = httpx.post(f"{text_url}/generate", json=body).json()
        text = last["text"]
    assert text == "Hello w"
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": "o"}
    expected_tokens = next(
        k for k in range(first_o + 2, len(ids) + 1) if detok(text_url, ids[:k]).count("o") == 2
    )
    assert last["meta_info"]["completion_tokens"] == expected_tokens
    assert rid not in httpx.get(f"{text_url}/get_server_info").json()["internal_states"][0]["aborted_rids"]


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"text": 5}',
        b'{"text": "a", "sampling_params": {"temperature": "hot"}}',
        b'{"text": "a", "sampling_params": {"top_p": 7.0}}',
        b'{"text": "a", "sampling_params": {"bogus": 1}}',
        b'{"text": "a", "input_ids": [1]}',
        b'{"text": "' + b"Hello world " * 200 + b'"}',
        b'{"text": "a", "sampling_params": {"max_new_tokens": 100000}}',
        b'{"text": ["a", "b"], "rid": "same"}',  # one rid for two prompts
        b'{"text": ["a", "b"], "rid": ["x", "x"]}',
        b'{"text": ["a", "b"], "rid": ["x", "x-1"], "sampling_params": [{"n": 2}, {}]}',  # x's sample x-1
        b'{"text": "a", "token_ids_logprob": [1]}',  # without return_logprob: not silently dropped
        b'{"text": "a", "return_logprob": true, "token_ids_logprob": [100000000]}',
        b'{"text": "a", "return_logprob": true, "token_ids_logprob": ["1"]}',
    ],
)
def test_generate_validation_is_400(url: str, body: bytes) -> None:
    assert_error(httpx.post(f"{url}/generate", content=body, headers=JSON), 400)


def test_queue_full_is_503(url: str) -> None:
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": 6}}
    assert_error(httpx.post(f"{url}/generate", json=body), 503)


def test_flush_cache_and_abort_request(url: str) -> None:
    assert httpx.post(f"{url}/flush_cache").status_code == 200
    body = {"text": "Hi", "rid": "long-1", "stream": True, "sampling_params": {"max_new_tokens": 200}}
    with httpx.Client(timeout=10) as client, httpx.stream("POST", f"{url}/generate", json=body) as resp:
        lines = resp.iter_lines()
        next(lines)
        assert_error(client.post(f"{url}/flush_cache"), 400)  # busy
        assert client.post(f"{url}/abort_request", json={"rid": "long-1"}).status_code == 200
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    assert "long-1" in aborted_rids(url)


@pytest.mark.parametrize("n", [1, 2])
def test_abort_returns_the_partial_output_of_non_streaming_requests(url: str, n: int) -> None:
    """The scheduler's final output for an aborted request carries the tokens so far; the waiting
    non-streaming caller (n > 1: aborted by the parent rid) gets them rather than empty text."""
    results: list[dict | list[dict]] = []
    rid = f"plain-abort-n{n}"
    body = {"text": "Hi", "rid": rid, "sampling_params": {"max_new_tokens": 240, "n": n}}
    thread = threading.Thread(
        target=lambda: results.append(httpx.post(f"{url}/generate", json=body, timeout=10).json())
    )
    thread.start()
    time.sleep(0.3)  # ~60 fake decode steps of 5 ms
    assert httpx.post(f"{url}/abort_request", json={"rid": rid}).status_code == 200
    thread.join(timeout=10)
    assert len(results) == 1
    outs = results[0] if n > 1 else [results[0]]
    assert len(outs) == n
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < out["meta_info"]["completion_tokens"] < 240
        assert out["text"] and len(out["output_ids"]) == out["meta_info"]["completion_tokens"]


def test_abort_reaches_samples_but_not_lookalike_rids(url: str) -> None:
    """Aborting "job" ends its n > 1 samples "job-0", "job-1" but not a request named "job-extra"."""
    results: dict[str, object] = {}

    def post(name: str, body: dict) -> None:
        results[name] = httpx.post(f"{url}/generate", json=body, timeout=10).json()

    long = {"max_new_tokens": 200}
    threads = [
        threading.Thread(
            target=post, args=("job", {"text": "Hi", "rid": "job", "sampling_params": {**long, "n": 2}})
        ),
        threading.Thread(
            target=post, args=("extra", {"text": "Hi", "rid": "job-extra", "sampling_params": long})
        ),
    ]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert httpx.post(f"{url}/abort_request", json={"rid": "job"}).status_code == 200
    for t in threads:
        t.join(timeout=10)
    assert [o["meta_info"]["finish_reason"]["type"] for o in results["job"]] == ["abort", "abort"]
    assert results["extra"]["meta_info"]["finish_reason"]["type"] == "length"


def aborted_rids(url: str) -> list[str]:
    deadline = time.monotonic() + 3
    while True:
        rids = httpx.get(f"{url}/get_server_info").json()["internal_states"][0]["aborted_rids"]
        if rids or time.monotonic() > deadline:
            return rids
        time.sleep(0.05)


def wait_aborted(url: str, rid: str) -> None:
    deadline = time.monotonic() + 4
    while rid not in aborted_rids(url):
        assert time.monotonic() < deadline, f"{rid} never aborted"
        time.sleep(0.05)


def test_client_disconnect_aborts_streaming_and_non_streaming(url: str) -> None:
    body = {"text": "Hi", "rid": "gone-stream", "stream": True, "sampling_params": {"max_new_tokens": 240}}
    with httpx.stream("POST", f"{url}/generate", json=body) as resp:
        next(resp.iter_lines())
    wait_aborted(url, "gone-stream")
    body = {"text": "Hi", "rid": "gone-plain", "sampling_params": {"max_new_tokens": 240}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=body, timeout=0.3)
    wait_aborted(url, "gone-plain")


# ----------------------------------------------------------------------------- OpenAI routes
def test_openai_completions(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    resp = client.completions.create(model="tiny", prompt=["Hello", "abc"], max_tokens=3, n=2, echo=True)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == "HelloHelloHelloHello" and resp.choices[2].text == "abcabc"
    assert resp.usage.prompt_tokens == 1 + 3 and resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    resp = client.completions.create(model="tiny", prompt=[67, 68], max_tokens=2, logprobs=1)
    assert resp.choices[0].text == detok(url, [67, 68]) and resp.choices[0].logprobs.token_logprobs == [
        -0.5,
        -0.5,
    ]


def test_openai_completions_stream_usage(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    stream = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finishes[c.index] = finishes.get(c.index, 0) + (c.finish_reason is not None)
    assert texts == {0: "Hello" * 4, 1: "Hello" * 4} and finishes == {0: 1, 1: 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_openai_chat(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    msgs = [{"role": "user", "content": "Hello"}]
    resp = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=5, seed=1)
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, stop=["user"], stream=True, logprobs=True, top_logprobs=1
    )
    chunks = list(stream)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert "user" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # No max_tokens: OpenAI's semantics, the rest of the context (the fake model never stops).
    resp = client.chat.completions.create(model="tiny", messages=msgs)
    assert resp.usage.completion_tokens == 256 - resp.usage.prompt_tokens > 128


def test_openai_errors(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=-1)
    assert_error(httpx.post(f"{url}/v1/chat/completions", json={"messages": "hi"}), 400)
    assert_error(httpx.post(f"{url}/v1/completions", content=b"[1,", headers=JSON), 400)
    assert assert_error(httpx.get(f"{url}/v1/models/nope"), 404)["code"] == "model_not_found"
    assert_error(httpx.get(f"{url}/no/such/route"), 404)
    assert_error(httpx.delete(f"{url}/generate"), 405)


def test_post_routes_take_json_only(url: str) -> None:
    """`curl -d '{...}'` sends application/x-www-form-urlencoded: every POST route needs
    application/json (a cross-site page can send a form or text/plain without a CORS preflight,
    never JSON), the read-only ones included."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    for path, body in [
        ("/v1/tokenize", b'{"prompt": "Hello world"}'),
        ("/v1/detokenize", b'{"tokens": [67]}'),
    ]:
        assert_error(httpx.post(f"{url}{path}", content=body, headers=form), 415)
        assert httpx.post(f"{url}{path}", content=body, headers=JSON).status_code == 200
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'
    completion = b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2}'
    for path, body in [
        ("/v1/chat/completions", chat),
        ("/v1/completions", completion),
        ("/generate", b'{"text": "Hi", "sampling_params": {"max_new_tokens": 2}}'),
        ("/abort_request", b'{"abort_all": true}'),
    ]:
        for headers in (form, {"Content-Type": "text/plain"}, {}):
            assert_error(httpx.post(f"{url}{path}", content=body, headers=headers), 415)
        assert httpx.post(f"{url}{path}", content=body, headers=JSON).status_code == 200
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=chat,
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_models_tokenize_metrics(url: str) -> None:
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert httpx.get(f"{url}/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(f"{url}/v1/models/default").json()["id"] == "tiny"  # as completions accept it
    tok = httpx.post(f"{url}/v1/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    text = httpx.post(f"{url}/v1/detokenize", json={"tokens": tok["tokens"]}).json()["text"]
    assert text == "Hello world"
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket"):
        assert f"sglang:{name}" in metrics


# ----------------------------------------------------------------------------- auth, lifecycle
def test_api_key(servers: dict[str, Server]) -> None:
    url = servers["auth"].url
    assert_error(httpx.get(f"{url}/v1/models"), 401)
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    info = httpx.get(f"{url}/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert info["api_key"] == "<redacted>" and API_KEY not in json.dumps(info)


def test_sigterm_finishes_in_flight_then_exits_0(servers: dict[str, Server]) -> None:
    server = servers["auth"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    info = httpx.get(f"{server.url}/get_server_info", headers=headers).json()
    scheduler_pid = info["internal_states"][0]["pid"]
    body = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 60}}
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=headers) as resp:
        lines = resp.iter_lines()
        next(lines)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["meta_info"]["finish_reason"]["type"] == "length"
    assert server.proc.wait(timeout=15) == 0
    with pytest.raises(ProcessLookupError):  # the children went with it
        os.kill(scheduler_pid, 0)


def test_dead_scheduler_makes_health_503_and_server_exit(servers: dict[str, Server]) -> None:
    server = servers["main"]  # the last test of the module: it kills this server
    pid = httpx.get(f"{server.url}/get_server_info").json()["internal_states"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    saw_503 = False
    while server.proc.poll() is None and time.monotonic() - killed < 5:
        try:
            saw_503 |= httpx.get(f"{server.url}/health", timeout=0.5).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert saw_503
    assert server.proc.wait(timeout=max(0.1, 5 - (time.monotonic() - killed))) != 0
