"""The real server on the tiny model under abuse: values that used to crash the scheduler are 400s
at the HTTP layer, and a storm of clients that disconnect mid-request leaves nothing running and
the KV pool full again (servers: conftest.py)."""

from __future__ import annotations

import os
import random
import re
import sys
import threading

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_helpers import TINY_LONG, client, generate, internal_state, pool_is_full  # noqa: E402
from server_helpers import assert_error, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(300)

JSON = {"Content-Type": "application/json"}
MSG = b'"messages": [{"role": "user", "content": "Hi"}]'


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", b'{"text": "Hi", "sampling_params": {"temperature": NaN, "max_new_tokens": 4}}'),
        ("/generate", b'{"text": "Hi", "sampling_params": {"temperature": Infinity, "max_new_tokens": 4}}'),
        (
            "/generate",
            b'{"text": "Hi", "sampling_params": {"repetition_penalty": 1e-30, "max_new_tokens": 4}}',
        ),
        ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 4, "temperature": NaN}'),
        ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 4, "repetition_penalty": 1e-30}'),
        ("/v1/chat/completions", b"{" + MSG + b', "max_tokens": 4, "temperature": NaN}'),
        ("/v1/chat/completions", b"{" + MSG + b', "max_tokens": 4, "top_p": Infinity}'),
        ("/generate", b'{"text": "Hi", "sampling_params": {"n": 1000, "max_new_tokens": 4}}'),
        ("/generate", b'{"text": "Hi", "return_logprob": true, "top_logprobs_num": 100000}'),
    ],
)
def test_values_that_crashed_the_scheduler_are_400_and_serving_goes_on(
    tiny: str, path: str, body: bytes
) -> None:
    assert_error(httpx.post(f"{tiny}{path}", content=body, headers=JSON, timeout=30), 400)
    out = generate(
        tiny, text="The capital of France is", sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    assert out["meta_info"]["completion_tokens"] == 4
    assert httpx.get(f"{tiny}/health").status_code == 200


def _tm_in_flight(url: str) -> tuple[float, float]:
    """The HTTP process's own count of requests it waits on (running, queued), from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text

    def gauge(name: str) -> float:
        match = re.search(rf"^sglang:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert match, name
        return float(match.group(1))

    return gauge("num_running_reqs"), gauge("num_queue_reqs")


def test_disconnect_storm_leaves_nothing_running_and_the_pool_full(tiny: str) -> None:
    """32 clients (streaming and not, native and OpenAI) go away at random points of their
    requests, some while still queued; afterwards no request is left anywhere and every KV slot
    is free again."""
    wait_until(lambda: pool_is_full(tiny), 10, "an idle pool")
    rng = random.Random(7)
    errors: list[BaseException] = []

    def streaming(i: int, events: int) -> None:
        body = {"text": f"Storm {i}", "stream": True, "sampling_params": TINY_LONG}
        with httpx.stream("POST", f"{tiny}/generate", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            for _ in range(events):
                next(lines)

    def plain(i: int, timeout: float) -> None:
        # The client gives up after `timeout`; on a fast machine a request may finish first,
        # which is fine too (it must then be a complete answer).
        body = {"text": f"Storm {i}", "sampling_params": TINY_LONG}
        try:
            resp = httpx.post(f"{tiny}/generate", json=body, timeout=timeout)
        except httpx.TimeoutException:
            return
        assert resp.status_code == 200, resp.text
        assert resp.json()["meta_info"]["completion_tokens"] == TINY_LONG["max_new_tokens"]

    def openai_stream(i: int, chunks: int) -> None:
        stream = client(tiny).completions.create(
            model="default",
            prompt=f"Storm {i}",
            max_tokens=1000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        for _ in range(chunks):
            next(it)
        stream.close()

    def guarded(fn, *args) -> None:  # noqa: ANN001 - any client function above
        try:
            fn(*args)
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    jobs = []
    for i in range(32):
        kind = i % 4
        if kind == 0:
            jobs.append((streaming, i, rng.randint(1, 6)))
        elif kind == 1:
            jobs.append((plain, i, rng.uniform(0.05, 1.5)))  # some leave before being scheduled
        elif kind == 2:
            jobs.append((openai_stream, i, rng.randint(1, 4)))
        else:
            jobs.append((streaming, i, 1))
    threads = [threading.Thread(target=guarded, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    wait_until(lambda: pool_is_full(tiny), 20, "the pool to be full after the storm")
    state = internal_state(tiny)
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0, state
    assert _tm_in_flight(tiny) == (0.0, 0.0)
    out = generate(
        tiny, text="The capital of France is", sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    assert out["meta_info"]["completion_tokens"] == 4
