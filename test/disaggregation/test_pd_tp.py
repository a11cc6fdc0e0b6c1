"""Real prefill and decode servers (tiny model, 127.0.0.1) of different TP sizes, driven as a PD
load balancer drives them (each request to both, with the same bootstrap_room), compared with a
colocated TP=1 server; then a decode server killed while its KV is on the way and while it
generates. Every wait is bounded and every process started here is stopped."""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from real_helpers import internal_state, random_ids, state_is_full  # noqa: E402
from server_helpers import Server, start_servers, wait_until  # noqa: E402

from radixserve.utils.network import get_free_port  # noqa: E402

# Four servers start in the fixture (and conftest.py's colocated one); a hang ends the test instead of the CI run.
pytestmark = pytest.mark.timeout(900)

POOL = "8192"
_rooms = itertools.count(5000)


class PDServer(Server):
    def __init__(self, model: str, mode: str, tp: int, bootstrap_port: int | None = None) -> None:
        flags = ["--max-total-tokens", POOL, "--chunked-prefill-size", "128", "--enable-metrics"]
        flags += ["--tp-size", str(tp), "--disaggregation-mode", mode]
        if bootstrap_port is not None:
            flags += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        self.bootstrap_port = bootstrap_port
        super().__init__(["-m", "radixserve.launch_server", "--model-path", model, *flags])


@pytest.fixture(scope="module")
def servers(tiny_llama_path, pd_reference):
    """Prefill and decode servers at TP 1 and 2 (any prefill pairs with any decode: the room's
    bootstrap address picks the prefill server), and the colocated reference (conftest.py's)."""
    made = {
        "p1": PDServer(tiny_llama_path, "prefill", 1, get_free_port()),
        "p2": PDServer(tiny_llama_path, "prefill", 2, get_free_port()),
        "d1": PDServer(tiny_llama_path, "decode", 1),
        "d2": PDServer(tiny_llama_path, "decode", 2),
    }
    try:
        colocated = pd_reference.get("colocated")  # started while the PD servers start
        yield {**start_servers(made, timeout=300), **colocated}
    finally:
        for server in made.values():
            server.stop()


def pd_post(prefill: PDServer, decode: Server, body: dict, timeout: float = 120) -> tuple[Any, Any]:
    """POST /generate to both halves at once with one new room; (prefill, decode) responses."""
    pd = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": next(_rooms),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(httpx.post, f"{s.url}/generate", json={**body, **pd}, timeout=timeout)
            for s in (prefill, decode)
        ]
        return futures[0].result(), futures[1].result()


def idle_and_full(server: Server) -> bool:
    s = internal_state(server.url)
    return (
        state_is_full(s)
        and all(
            r["memory_leak"] is None
            and r["available_tokens"] + r["evictable_tokens"] == r["max_total_num_tokens"]
            for r in s["ranks"]
        )
        and s.get("num_bootstrap_queue_reqs", 0) + s.get("num_inflight_queue_reqs", 0) == 0
        and s.get("num_prealloc_queue_reqs", 0) + s.get("num_transfer_queue_reqs", 0) == 0
    )


def assert_full(*servers: Server) -> None:
    for server in servers:
        wait_until(lambda s=server: idle_and_full(s), 30, f"{server.url}'s pools (every rank) back to full")


def metric(server: Server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        # SGLang's form: sglang:<name>{model_name="<served model>"} <value>
        if re.match(rf"sglang:{name}(\{{[^}}]*\}})? ", line):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


PROMPTS = [random_ids(1, 6), random_ids(2, 100), random_ids(3, 300), random_ids(4, 17)]


@pytest.mark.parametrize(("prefill", "decode"), [("p1", "d2"), ("p2", "d1"), ("p2", "d2"), ("p1", "d1")])
def test_greedy_parity_across_tp_sizes(servers, prefill, decode):
    p, d = servers[prefill], servers[decode]
    for ids in PROMPTS + PROMPTS[1:2]:  # the repeat hits the prefill side's radix cache
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        want = httpx.post(f"{servers['colocated'].url}/generate", json=body, timeout=120).json()
        got_p, got_d = pd_post(p, d, body)
        assert got_p.status_code == 200 and got_d.status_code == 200, (got_p.text, got_d.text)
        assert got_d.json()["output_ids"] == want["output_ids"]
        assert got_p.json()["output_ids"] == want["output_ids"][:1]
    assert internal_state(p.url)["cache_hit_tokens"] > 0
    assert_full(p, d)


def test_token_counters_match_the_colocated_server(servers):
    """/metrics and get_server_info of each half count what a colocated server counts for the
    same work: the decode server the whole answer, the prefill server one token per request."""
    p, d, c = servers["p1"], servers["d2"], servers["colocated"]
    names = ("generation_tokens_total", "prompt_tokens_total")
    before = {s: {n: metric(servers[s], n) for n in names} for s in ("p1", "d2", "colocated")}
    body = {
        "input_ids": random_ids(9, 40),
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    assert httpx.post(f"{c.url}/generate", json=body, timeout=120).status_code == 200
    got_p, got_d = pd_post(p, d, body)
    assert got_p.status_code == 200 and got_d.status_code == 200
    delta = {s: {n: metric(servers[s], n) - before[s][n] for n in names} for s in before}
    assert delta["d2"] == delta["colocated"] == {"generation_tokens_total": 12, "prompt_tokens_total": 40}
    assert delta["p1"] == {"generation_tokens_total": 1, "prompt_tokens_total": 40}


def test_decode_killed_mid_transfer_then_mid_generation_last(servers):
    """Runs last (it kills d1). The prefill server frees the request's KV, answers it with an
    error, and serves the next request; the decode server's client gets an error, not a hang."""
    p, victim, other = servers["p1"], servers["d1"], servers["d2"]
    t0 = time.monotonic()
    # Mid-generation: d1 streams a long answer, then dies.
    body = {"input_ids": random_ids(5, 50), "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": next(_rooms)}
    results: dict[str, Any] = {}

    def prefill_half() -> None:
        results["p"] = httpx.post(f"{p.url}/generate", json={**body, **pd}, timeout=60)

    # Slow the decode server down (50 ms a step) so it is surely still generating when it dies.
    assert (
        httpx.post(f"{victim.url}/slow_down", json={"forward_sleep_time": 0.05}, timeout=30).status_code
        == 200
    )
    thread = threading.Thread(target=prefill_half)
    thread.start()
    with httpx.stream(
        "POST", f"{victim.url}/generate", json={**body, **pd, "stream": True}, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # generation has begun
        # Slow the prefill server down, so the next request's KV is still being computed when
        # the decode server dies (it has bootstrapped and allocated its pages by then).
        assert httpx.post(f"{p.url}/slow_down", json={"forward_sleep_time": 3}, timeout=30).status_code == 200
        thread.join(timeout=60)
        body2 = {"input_ids": random_ids(6, 200), "sampling_params": {"max_new_tokens": 8}}
        pd2 = {**pd, "bootstrap_room": next(_rooms)}
        with ThreadPoolExecutor(2) as pool:
            prefill2 = pool.submit(httpx.post, f"{p.url}/generate", json={**body2, **pd2}, timeout=60)
            decode2 = pool.submit(httpx.post, f"{victim.url}/generate", json={**body2, **pd2}, timeout=60)
            wait_until(
                lambda: internal_state(victim.url)["num_transfer_queue_reqs"] == 1, 30, "d1 to wait for KV"
            )
            victim.proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
            with pytest.raises(httpx.HTTPError):  # the stream ends with an error, not a hang
                for _ in lines:
                    pass
            with pytest.raises(httpx.HTTPError):
                decode2.result()
            got = prefill2.result()
    assert results["p"].status_code == 200  # the first request's prefill half was long done
    assert got.status_code == 503, got.text
    assert "decode server disconnected" in got.json()["error"]["message"]
    assert httpx.post(f"{p.url}/slow_down", json={"forward_sleep_time": None}, timeout=30).status_code == 200
    assert_full(p)
    # The prefill server is healthy: the next request, with another decode server, works.
    ids = random_ids(7, 30)
    body3 = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    want = httpx.post(f"{servers['colocated'].url}/generate", json=body3, timeout=120).json()["output_ids"]
    got_p, got_d = pd_post(p, other, body3)
    assert got_d.status_code == 200 and got_d.json()["output_ids"] == want
    assert_full(p, other)
    assert time.monotonic() - t0 < 120
