"""Issue 46 (items 3 and 6) over ZMQ with the fake scheduler: every POST route takes JSON only,
/get_weights_by_name answers at most truncate_size rows (and never a whole large weight) without
stalling /health, and /health_generate answers a busy server healthy without queueing a probe."""

from __future__ import annotations

import os
import sys
import threading
import time

import httpx
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fake_control import FAKE_WEIGHTS  # noqa: E402
from server_helpers import SharedServers, assert_error, wait_until  # noqa: E402

from radixserve.managers.control_messages import MAX_WEIGHT_REPLY_ELEMENTS  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def url(fake_servers: SharedServers) -> str:
    """conftest's shared fake server (test_http_fake.py's "main": --max-queued-requests 4, which
    test_busy_server_is_healthy_without_a_probe fills); every test here leaves it idle and counts
    the scheduler's requests before and after."""
    return fake_servers.get("main")["main"].url


def _num_received(url: str) -> int:
    return httpx.get(f"{url}/get_server_info", timeout=10).json()["internal_states"][0]["num_received"]


# ----------------------------------------------------------------------------- item 3
def test_a_page_cannot_read_weights_or_tokenize(url: str) -> None:
    """text/plain and forms are what a cross-site page sends without a preflight."""
    for path, body in [
        ("/get_weights_by_name", b'{"name": "model.norm.weight"}'),
        ("/v1/tokenize", b'{"prompt": "Hello"}'),
        ("/v1/detokenize", b'{"tokens": [67]}'),
    ]:
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            assert_error(httpx.post(f"{url}{path}", content=body, headers={"Content-Type": ctype}), 415)
        ok = httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"})
        assert ok.status_code == 200, ok.text


def test_weights_answer_truncate_size_rows(url: str) -> None:
    rows, width = FAKE_WEIGHTS[EMBED]
    got = httpx.post(f"{url}/get_weights_by_name", json={"name": EMBED}, timeout=30)
    assert got.status_code == 200 and got.headers["content-type"] == "application/json"
    expected = (np.arange(100 * width, dtype=np.float32) / 1000).reshape(100, width)
    assert np.array_equal(np.asarray(got.json(), dtype=np.float32), expected)  # SGLang's default: 100
    two = httpx.post(f"{url}/get_weights_by_name", json={"name": EMBED, "truncate_size": 2}).json()
    assert np.array_equal(np.asarray(two, dtype=np.float32), expected[:2])
    norm = httpx.post(f"{url}/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 5})
    assert norm.json() == [0.0, 0.001, 0.002, 0.003, 0.004]
    whole = httpx.post(f"{url}/get_weights_by_name", json={"name": EMBED, "truncate_size": 10**9})
    limit = MAX_WEIGHT_REPLY_ELEMENTS // width
    assert rows > limit and f"truncate_size <= {limit}" in assert_error(whole, 400)["message"]


def test_the_largest_weights_answer_does_not_stall_health(url: str) -> None:
    width = FAKE_WEIGHTS[EMBED][1]
    limit = MAX_WEIGHT_REPLY_ELEMENTS // width
    latencies: list[float] = []
    done = threading.Event()

    def probe_health() -> None:
        with httpx.Client(timeout=10) as client:
            while not done.is_set():
                started = time.perf_counter()
                assert client.get(f"{url}/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

    thread = threading.Thread(target=probe_health)
    thread.start()
    try:
        for _ in range(2):
            body = {"name": EMBED, "truncate_size": limit}
            resp = httpx.post(f"{url}/get_weights_by_name", json=body, timeout=60)
            assert resp.status_code == 200 and len(resp.content) > 20_000_000
    finally:
        done.set()
        thread.join()
    assert len(resp.json()) == limit
    assert len(latencies) > 10 and max(latencies) < 0.2, f"/health took up to {max(latencies):.3f} s"


# ----------------------------------------------------------------------------- item 6
def test_busy_server_is_healthy_without_a_probe(url: str) -> None:
    """The queue is full (4 streams): a probe would be refused or wait behind the load, yet the
    server is producing tokens, so it is healthy, and no probe is queued."""
    body = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 200}}
    with httpx.Client(timeout=10) as client:
        streams = [client.stream("POST", f"{url}/generate", json=body) for _ in range(4)]
        lines = [s.__enter__().iter_lines() for s in streams]  # kept: a dropped iterator disconnects
        try:
            for it in lines:
                next(it)  # all four admitted: the queue (--max-queued-requests 4) is full
            before = _num_received(url)
            started = time.perf_counter()
            resp = client.get(f"{url}/health_generate")
            assert resp.status_code == 200, resp.text
            assert time.perf_counter() - started < 1.0
            assert _num_received(url) == before  # no probe reached the scheduler
        finally:
            for s in streams:
                s.__exit__(None, None, None)


def test_idle_server_is_probed(url: str) -> None:
    wait_until(lambda: httpx.post(f"{url}/flush_cache").status_code == 200, 10, "an idle server")
    time.sleep(1.2)  # past RECENT_OUTPUT_S: no recent output
    before = _num_received(url)
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    assert _num_received(url) == before + 1  # the 1-token probe ran
