"""A real prefill server and decode server (tiny model) driven by the SGLang Model Gateway
(`python -m sglang_router.launch_router --pd-disaggregation`), compared with one colocated server.

Skipped, with the reason, where the sglang-router wheel is not installed. Everything binds
127.0.0.1, every wait is bounded, and every process started here is stopped.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from real_helpers import internal_state, state_is_full  # noqa: E402
from server_helpers import Server, wait_until  # noqa: E402

from radixserve.utils.network import get_free_port  # noqa: E402

try:
    import sglang_router  # noqa: F401

    ROUTER_MISSING = None
except ImportError as exc:
    ROUTER_MISSING = f"sglang-router is not installed ({exc}); pip install sglang-router to run it"
    print(f"SKIP test_pd_servers: {ROUTER_MISSING}")

pytestmark = pytest.mark.skipif(ROUTER_MISSING is not None, reason=ROUTER_MISSING or "")

POOL = "8192"


class Router(Server):
    """`sglang_router.launch_router --pd-disaggregation` over one prefill and one decode server
    (Server gives it a free port on 127.0.0.1 and stops it)."""

    def __init__(self, prefill: Server, bootstrap_port: int, decode: Server) -> None:
        self.bootstrap_port = bootstrap_port
        argv = ["-m", "sglang_router.launch_router", "--pd-disaggregation"]
        argv += ["--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url]
        argv += ["--host", "127.0.0.1", "--prometheus-port", str(get_free_port()), "--log-level", "warn"]
        super().__init__(argv)

    def wait_ready(self, timeout: float = 120) -> None:
        def serves() -> bool:
            assert self.proc.poll() is None, "the router exited"
            try:
                body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
                return httpx.post(f"{self.url}/generate", json=body, timeout=30).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(serves, timeout, "the router to serve through its PD pair", interval=1.0)


@pytest.fixture(scope="module")
def stack(tiny_llama_path, pd_reference):
    bootstrap_port = get_free_port()
    common = ("--max-total-tokens", POOL, "--chunked-prefill-size", "256")
    servers = {
        "prefill": Server.real(
            tiny_llama_path,
            *common,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
        ),
        "decode": Server.real(tiny_llama_path, *common, "--disaggregation-mode", "decode"),
    }
    router = None
    try:
        colocated = pd_reference.get("colocated")["colocated"]  # conftest.py's, started meanwhile
        for server in servers.values():
            server.wait_ready(timeout=300)
        router = Router(servers["prefill"], bootstrap_port, servers["decode"])
        router.wait_ready()
        yield {**servers, "colocated": colocated, "router": router}
    finally:
        if router is not None:
            router.stop()
        for server in servers.values():
            server.stop()


def post(url: str, path: str, body: dict, timeout: float = 120) -> dict:
    resp = httpx.post(f"{url}{path}", json=body, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def state(server: Server) -> dict:
    return internal_state(server.url)


def idle_and_full(server: Server) -> bool:
    """The pool is full, no rank leaked, and nothing is left in either side's PD queues."""
    s = state(server)
    return (
        state_is_full(s)
        and all(r["memory_leak"] is None for r in s["ranks"])
        and s.get("num_bootstrap_queue_reqs", 0) + s.get("num_inflight_queue_reqs", 0) == 0
        and s.get("num_prealloc_queue_reqs", 0) + s.get("num_transfer_queue_reqs", 0) == 0
    )


def assert_pools_full(stack: dict) -> None:
    for name in ("prefill", "decode"):
        wait_until(lambda n=name: idle_and_full(stack[n]), 30, f"{name}'s pool back to full")


PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 120)), list(range(3, 303)), [42] * 17]


def test_generate_parity_through_the_gateway(stack):
    for ids in PROMPTS + PROMPTS[:2]:  # the repeats hit the prefill side's radix cache
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        want = post(stack["colocated"].url, "/generate", body)
        got = post(stack["router"].url, "/generate", body)
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert state(stack["prefill"])["cache_hit_tokens"] >= len(PROMPTS[0]) + len(PROMPTS[1]) - 2
    assert state(stack["prefill"])["kv_transfers"] >= len(PROMPTS) + 2
    assert_pools_full(stack)


def test_batch_and_streaming_through_the_gateway(stack):
    body = {"input_ids": PROMPTS[:3], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    want = [o["output_ids"] for o in post(stack["colocated"].url, "/generate", body)]
    got = [o["output_ids"] for o in post(stack["router"].url, "/generate", body)]
    assert got == want
    one = {
        "input_ids": PROMPTS[1],
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        "stream": True,
    }
    with httpx.stream("POST", f"{stack['router'].url}/generate", json=one, timeout=120) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["output_ids"] == want[1]
    assert_pools_full(stack)


def test_openai_routes_through_the_gateway(stack):
    model = httpx.get(f"{stack['colocated'].url}/v1/models", timeout=30).json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 10}
    chat["temperature"] = 0
    want = post(stack["colocated"].url, "/v1/chat/completions", chat)
    got = post(stack["router"].url, "/v1/chat/completions", chat)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    comp = {"model": model, "prompt": "abc def", "max_tokens": 10, "temperature": 0}
    want = post(stack["colocated"].url, "/v1/completions", comp)
    got = post(stack["router"].url, "/v1/completions", comp)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    stream = {**comp, "stream": True}
    with httpx.stream("POST", f"{stack['router'].url}/v1/completions", json=stream, timeout=120) as resp:
        chunks = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks if c != "[DONE]")
    assert text == want["choices"][0]["text"]
    assert_pools_full(stack)


def test_prompt_logprobs_merged_from_the_prefill_side(stack):
    body = {
        "input_ids": PROMPTS[1][:30],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    want = post(stack["colocated"].url, "/generate", body)["meta_info"]
    got = post(stack["router"].url, "/generate", body)["meta_info"]
    assert len(got["input_token_logprobs"]) == 30
    assert [t for _, t, _ in got["input_token_logprobs"]] == [t for _, t, _ in want["input_token_logprobs"]]
    for (a, _, _), (b, _, _) in zip(got["input_token_logprobs"][1:], want["input_token_logprobs"][1:]):
        assert a == pytest.approx(b, abs=1e-4)
    assert [t for _, t, _ in got["output_token_logprobs"]] == [t for _, t, _ in want["output_token_logprobs"]]
    assert_pools_full(stack)


def test_health_probes_use_the_fake_bootstrap_host(stack):
    for name in ("prefill", "decode"):
        assert httpx.get(f"{stack[name].url}/health_generate", timeout=60).status_code == 200
    assert httpx.get(f"{stack['router'].url}/health", timeout=30).status_code == 200
    assert_pools_full(stack)


def test_a_request_without_a_room_is_refused_clearly(stack):
    resp = httpx.post(f"{stack['decode'].url}/generate", json={"input_ids": [5, 6]}, timeout=30)
    assert resp.status_code == 400 and "bootstrap_room" in resp.json()["error"]["message"]


def test_client_disconnect_frees_both_sides(stack):
    body = {
        "input_ids": PROMPTS[2],
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    with httpx.stream("POST", f"{stack['router'].url}/generate", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # the first tokens arrived: go away mid-generation
    assert_pools_full(stack)
    assert state(stack["decode"])["num_running_reqs"] == 0


def test_prefill_dies_mid_transfer_last(stack):
    """Runs last: kills the prefill server while the decode server waits for KV."""
    decode, prefill = stack["decode"], stack["prefill"]
    bootstrap_port = stack["router"].bootstrap_port
    body = {
        "input_ids": list(range(3, 380)) * 2,
        "sampling_params": {"max_new_tokens": 8},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": 424242,
    }
    # The decode side alone: it bootstraps, allocates and waits for KV that never comes.
    with httpx.Client(timeout=120) as client:
        t0 = time.monotonic()
        wait_until(lambda: state(decode)["num_transfer_queue_reqs"] == 0, 10, "decode idle")

        result: dict = {}
        thread = threading.Thread(
            target=lambda: result.update(r=client.post(f"{decode.url}/generate", json=body))
        )
        thread.start()
        wait_until(
            lambda: state(decode)["num_transfer_queue_reqs"] == 1, 60, "the decode side to wait for KV"
        )
        prefill.proc.kill()
        prefill.proc.wait()
        thread.join(timeout=60)
    resp = result["r"]
    assert resp.status_code == 503, resp.text
    assert "disconnected" in resp.json()["error"]["message"]
    assert time.monotonic() - t0 < 60
    wait_until(lambda: idle_and_full(decode), 30, "decode's pool back to full")
