"""The SGLang Model Gateway (`pip install radixserve[router]`: the Rust router of the PyPI package
sglang-router) in front of unchanged radixserve servers, in its regular (HTTP) mode: its start-up
checks (/health, /server_info or /get_server_info, /model_info), /generate and the OpenAI routes
through it, streaming and not, with the same greedy answers as the worker gives directly; its
/flush_cache and /get_loads fan-outs; and --dp-aware against a --dp-size 2 server (the router
sends data_parallel_rank, both replicas serve). Skipped, with the reason, without the wheel."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from server_helpers import sse_events  # noqa: E402

from radixserve.utils.network import get_free_port  # noqa: E402

pytestmark = pytest.mark.timeout(900)


if importlib.util.find_spec("sglang_router") is None:
    REASON = "sglang-router is not installed (pip install 'radixserve[router]'): the Gateway test cannot run"
    print(f"SKIPPED test_gateway: {REASON}")
    pytest.skip(REASON, allow_module_level=True)


class Router:
    """`python -m sglang_router.launch_router --worker-urls ... --policy ...` on a free port."""

    def __init__(self, worker_urls: list[str], *flags: str, log_path: str) -> None:
        self.port = get_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(self.port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(get_free_port()),  # two routers must not share the default 29000
            "--worker-urls", *worker_urls, *flags,
        ]  # fmt: skip
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_workers(self, count: int, timeout: float = 120) -> None:
        """Until the router lists `count` healthy workers (it adds them in the background)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited: {open(self.log_path).read()[-3000:]}"
            try:
                resp = httpx.get(f"{self.url}/get_loads", timeout=2)
                if resp.status_code == 200 and len(resp.json().get("workers", [])) >= count:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"router has no {count} workers: {open(self.log_path).read()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _greedy(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "temperature": 0} if "sampling_params" not in body else body


@pytest.fixture(scope="module")
def fleet(dp_servers, tmp_path_factory):
    """Two radixserve servers, one replica and --dp-size 2 (conftest.py's, shared with
    test_data_parallel_server.py: they give the same greedy tokens), behind a cache_aware router."""
    servers = dp_servers.get("dp1", "dp2")
    workers = {"a": servers["dp1"], "b": servers["dp2"]}
    log = str(tmp_path_factory.mktemp("router") / "router.log")
    router = Router([w.url for w in workers.values()], "--policy", "cache_aware", log_path=log)
    try:
        router.wait_workers(2)
        yield router, workers
    finally:
        router.stop()


def test_generate_through_the_gateway_streaming_and_not(fleet) -> None:
    router, workers = fleet
    body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    direct = httpx.post(f"{workers['a'].url}/generate", json=body, timeout=60).json()
    via = httpx.post(f"{router.url}/generate", json=body, timeout=60)
    assert via.status_code == 200, via.text
    assert via.json()["output_ids"] == direct["output_ids"]
    with httpx.stream("POST", f"{router.url}/generate", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    import json

    assert json.loads(events[-2])["output_ids"] == direct["output_ids"]


def test_openai_routes_through_the_gateway_streaming_and_not(fleet) -> None:
    router, workers = fleet
    import json

    model = httpx.get(f"{workers['a'].url}/v1/models", timeout=30).json()["data"][0]["id"]
    cases = {
        "/v1/completions": {"model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
        "/v1/chat/completions": {
            "model": model,
            "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": 8,
            "temperature": 0,
        },
    }
    for route, body in cases.items():
        direct = httpx.post(f"{workers['b'].url}{route}", json=body, timeout=60).json()
        via = httpx.post(f"{router.url}{route}", json=body, timeout=60)
        assert via.status_code == 200, (route, via.text)
        choice, want = via.json()["choices"][0], direct["choices"][0]
        text = choice.get("text", (choice.get("message") or {}).get("content"))
        assert text == want.get("text", (want.get("message") or {}).get("content")), route
        with httpx.stream("POST", f"{router.url}{route}", json={**body, "stream": True}, timeout=60) as resp:
            assert resp.status_code == 200, route
            events = sse_events(resp)
        assert events[-1] == "[DONE]", route
        pieces = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e).get("choices")]
        streamed = "".join(p.get("text") or (p.get("delta") or {}).get("content") or "" for p in pieces)
        assert streamed == text, route


def test_gateway_flush_cache_and_loads_reach_every_worker(fleet) -> None:
    router, _ = fleet
    flushed = httpx.post(f"{router.url}/flush_cache", timeout=60)
    assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2, flushed.text
    loads = httpx.get(f"{router.url}/get_loads", timeout=60).json()["workers"]
    assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads


def _cache_query_tokens(url: str) -> list[int]:
    states = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]
    return [s["cache_query_tokens"] for s in states]


def test_dp_aware_gateway_uses_both_replicas(dp_servers, tmp_path) -> None:
    server = dp_servers.get("dp2")["dp2"]  # shared: each replica's count is compared with its own before
    router = Router([server.url], "--policy", "round_robin", "--dp-aware", log_path=str(tmp_path / "r.log"))
    try:
        router.wait_workers(2)  # one worker per replica: "<url>@0" and "<url>@1"
        before = _cache_query_tokens(server.url)
        for i in range(4):
            body = {"text": f"prompt number {i} " * 3, "sampling_params": {"max_new_tokens": 4}}
            resp = httpx.post(f"{router.url}/generate", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
        after = _cache_query_tokens(server.url)
        assert len(after) == 2 and all(a > b for a, b in zip(after, before)), (before, after)
    finally:
        router.stop()
