"""The real server on real models: models/tokenize/metrics, validation (400s), aborts, queue-full
503, and a killed scheduler (servers: conftest.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any

import httpx
import openai
import psutil
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_helpers import (  # noqa: E402
    LONG,
    TINY_LONG,
    client,
    generate,
    internal_state,
    pool_is_full,
)
from server_helpers import (  # noqa: E402
    Server,
    assert_error,
    sse_events,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------- models, tokenize, metrics
def test_models_tokenize_detokenize(tiny: str, tiny_llama_path: str, tiny_tokenizer: Any) -> None:
    c = client(tiny)
    models = c.models.list()
    assert [m.id for m in models.data] == [tiny_llama_path]
    assert c.models.retrieve(tiny_llama_path).id == tiny_llama_path
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
    err = assert_error(httpx.get(f"{tiny}/v1/models/no-such-model"), 404)
    assert err["code"] == "model_not_found"
    model = httpx.get(f"{tiny}/v1/models/{tiny_llama_path}").json()
    assert model["object"] == "model" and model["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x", max_tokens=1)

    text = "Hello world, the quick brown fox"
    tok = httpx.post(f"{tiny}/v1/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == tiny_tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 1024
    both = httpx.post(f"{tiny}/v1/tokenize", json={"prompt": [text, "Paris"]}).json()
    assert both["tokens"][0] == tok["tokens"] and both["count"] == [len(t) for t in both["tokens"]]
    detok = httpx.post(f"{tiny}/v1/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["text"] == text
    detok = httpx.post(f"{tiny}/v1/detokenize", json={"tokens": both["tokens"]}).json()
    assert detok["text"] == [text, "Paris"]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        # SGLang's form: sglang:<name>{model_name="<served model>"} <value>
        if re.match(rf"sglang:{name}(\{{[^}}]*\}})? ", line):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics(tiny: str) -> None:
    before = httpx.get(f"{tiny}/metrics").text
    generate(tiny, text="Hello", sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    resp = httpx.get(f"{tiny}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    after = resp.text
    assert _metric(after, "num_requests_total") == _metric(before, "num_requests_total") + 1
    assert _metric(after, "generation_tokens_total") >= _metric(before, "generation_tokens_total") + 5
    assert _metric(after, "prompt_tokens_total") > _metric(before, "prompt_tokens_total")
    assert "sglang:time_to_first_token_seconds_bucket{" in after
    assert 'sglang:num_requests_total{model_name="' in after  # SGLang's label, on every series
    # The scheduler reports each request's queue time with its first output.
    assert _metric(after, "queue_time_seconds_count") == _metric(before, "queue_time_seconds_count") + 1


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", b"{not json"),
        ("/generate", b"null"),
        ("/generate", b'{"text": 5}'),
        ("/generate", b'{"input_ids": [1, "x"]}'),
        ("/generate", b'{"input_ids": [1, 99999]}'),
        ("/generate", b'{"input_ids": []}'),
        ("/generate", b'{"text": "a", "input_ids": [1]}'),
        ("/generate", b'{"text": ["a", "b"], "sampling_params": [{}]}'),
        ("/generate", b'{"text": "a", "sampling_params": {"temperature": "hot"}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"temperature": -1}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"top_p": 1.5}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"top_k": 0}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"min_p": 2}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"n": 0}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": 100000}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"stop_token_ids": [999999]}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"bogus": 1}}'),
        ("/generate", b'{"text": "a", "return_logprob": true, "top_logprobs_num": -1}'),
        ("/v1/completions", b"[1,"),
        ("/v1/completions", b"[1]"),
        ("/v1/completions", b'{"prompt": 5}'),
        ("/v1/completions", b'{"prompt": []}'),
        ("/v1/completions", b'{"prompt": ""}'),
        ("/v1/completions", b'{"prompt": [1, -3]}'),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": -1}'),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 100000}'),
        ("/v1/completions", b'{"prompt": "a", "n": 0}'),
        ("/v1/completions", b'{"prompt": "a", "n": -1}'),
        ("/v1/completions", b'{"prompt": "a", "n": 0, "stream": true}'),
        ("/v1/completions", b'{"prompt": "a", "temperature": -1, "stream": true}'),
        ("/v1/completions", b'{"prompt": "a", "logprobs": 50}'),
        ("/v1/completions", b'{"prompt": "a", "presence_penalty": 9}'),
        ("/v1/completions", b'{"prompt": "a", "stop": [1]}'),
        ("/v1/completions", b'{"prompt": "a", "seed": 1.5}'),
        ("/v1/completions", b'{"prompt": "a", "min_tokens": 10, "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "a", "stream_options": 3}'),
        ("/v1/chat/completions", b'{"messages": "hi"}'),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "bogus", "content": "x"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0, "stream": true}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2}',
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}',
        ),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"99999999": 1}}'),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"a": 1}}'),
        ("/v1/tokenize", b'{"prompt": 5}'),
        ("/v1/detokenize", b'{"tokens": ["a"]}'),
        ("/v1/detokenize", b'{"tokens": [-1]}'),
        ("/v1/detokenize", b'{"tokens": [[1], [99999]]}'),
        ("/abort_request", b"{bad"),
        ("/abort_request", b"{}"),
    ],
)
def test_bad_requests_are_400(tiny: str, path: str, body: bytes) -> None:
    resp = httpx.post(f"{tiny}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert_error(resp, 400)


def test_bad_requests_via_openai_are_400(tiny: str) -> None:
    c = client(tiny)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="default", prompt="x", max_tokens=1, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="default", prompt="x", max_tokens=1, top_p=3.0, stream=True)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="default", messages=[], max_tokens=1)
    assert httpx.get(f"{tiny}/health").status_code == 200


# ----------------------------------------------------------------------------- aborts
def test_killed_streaming_client_frees_the_pool(builtin: str) -> None:
    wait_until(lambda: pool_is_full(builtin), 5, "an idle pool")
    body = {"text": "Hello", "stream": True, "sampling_params": LONG}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{builtin}/generate", json=body) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        assert internal_state(builtin)["num_running_reqs"] == 1
    # Leaving the block closed the connection mid-stream.
    wait_until(lambda: pool_is_full(builtin), 2, "the pool to be full after the client went away")
    # The same through the openai package: close the stream object.
    stream = client(builtin).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    assert internal_state(builtin)["num_running_reqs"] == 1
    stream.close()
    wait_until(lambda: pool_is_full(builtin), 2, "the pool to be full after the openai stream closed")


def test_timed_out_non_streaming_client_frees_the_pool(builtin: str) -> None:
    body = {"text": "Hello", "sampling_params": LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{builtin}/generate", json=body, timeout=1.0)
    wait_until(lambda: pool_is_full(builtin), 2, "the pool to be full after the client timed out")
    timing_out = openai.OpenAI(base_url=f"{builtin}/v1", api_key="none", max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        timing_out.completions.create(
            model="default", prompt="Hello", max_tokens=2000, extra_body={"ignore_eos": True}
        )
    wait_until(lambda: pool_is_full(builtin), 2, "the pool to be full after the openai client timed out")


def test_abort_all_during_16_long_decodes(builtin: str) -> None:
    results: dict[int, Any] = {}

    def streaming(i: int) -> None:
        body = {"text": f"Prompt number {i}", "stream": True, "sampling_params": LONG}
        with httpx.stream("POST", f"{builtin}/generate", json=body, timeout=60) as resp:
            events = sse_events(resp)
        assert events[-1] == "[DONE]"
        results[i] = json.loads(events[-2])

    def plain(i: int) -> None:
        body = {"text": f"Prompt number {i}", "sampling_params": LONG}
        results[i] = httpx.post(f"{builtin}/generate", json=body, timeout=60).json()

    threads = [threading.Thread(target=streaming if i % 2 else plain, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    wait_until(lambda: internal_state(builtin)["num_running_reqs"] == 16, 30, "16 running requests")
    time.sleep(0.3)  # a few decode steps
    assert httpx.post(f"{builtin}/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == list(range(16))
    for i, out in results.items():
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out
        assert out["meta_info"]["completion_tokens"] < 2000
        # Streamed or not, the caller gets the tokens generated before the abort.
        assert out["meta_info"]["completion_tokens"] > 0 and out["text"], (i, out)
    assert httpx.get(f"{builtin}/health").status_code == 200
    wait_until(lambda: pool_is_full(builtin), 2, "the pool to be full after abort_all")
    out = generate(
        builtin, text="The capital of France is", sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    assert "Paris" in out["text"]


# ----------------------------------------------------------------------------- the limited server
def test_queue_full_is_503(servers: dict[str, Server]) -> None:
    """One request runs, one waits; the rest are refused with 503 (plain HTTP and openai)."""
    url = servers["limited"].url
    wait_until(lambda: pool_is_full(url), 5, "an idle pool")
    outcomes: list[int] = []

    def post(i: int) -> None:
        body = {"text": f"Hello {i}", "sampling_params": TINY_LONG}
        resp = httpx.post(f"{url}/generate", json=body, timeout=60)
        if resp.status_code == 503:
            assert_error(resp, 503)
        outcomes.append(resp.status_code)

    def via_openai() -> None:
        try:
            client(url).completions.create(
                model="default", prompt="Hi", max_tokens=1000, extra_body={"ignore_eos": True}
            )
            outcomes.append(200)
        except openai.APIStatusError as exc:
            outcomes.append(exc.status_code)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=via_openai))
    for t in threads:
        t.start()
    wait_until(lambda: outcomes.count(503) >= 3, 30, "three requests refused")
    assert httpx.post(f"{url}/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(timeout=60)
    assert len(outcomes) == 5 and set(outcomes) == {200, 503}, outcomes
    assert httpx.get(f"{url}/health").status_code == 200
    wait_until(lambda: pool_is_full(url), 2, "an idle pool after the aborts")


def _scheduler_process(server: Server) -> psutil.Process:
    """The scheduler is the first child that multiprocessing spawned (the detokenizer comes next)."""
    kids = [p for p in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(kids) == 2, [p.cmdline() for p in kids]
    return min(kids, key=lambda p: (p.create_time(), p.pid))


def test_killed_scheduler_makes_health_503_and_server_exit(servers: dict[str, Server]) -> None:
    server = servers["limited"]  # the last test of the module: it kills this server
    url = server.url
    wait_until(lambda: pool_is_full(url), 5, "an idle pool")
    scheduler = _scheduler_process(server)
    events: list[str] = []

    def stream() -> None:
        body = {"text": "Hello", "stream": True, "sampling_params": TINY_LONG}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    thread = threading.Thread(target=stream)
    thread.start()
    wait_until(lambda: events, 10, "a running request")
    os.kill(scheduler.pid, signal.SIGKILL)
    killed = time.monotonic()
    saw_503 = False
    while server.proc.poll() is None and time.monotonic() - killed < 5:
        try:
            saw_503 |= httpx.get(f"{url}/health", timeout=0.5).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert saw_503
    assert server.proc.wait(timeout=max(0.1, 5 - (time.monotonic() - killed))) != 0
    thread.join(timeout=10)
    # The request in flight ended with an error (in-band: the stream had started), not a hang.
    assert not thread.is_alive() and events[-1] == "[DONE]"
    reason = json.loads(events[-2])["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 503, reason
