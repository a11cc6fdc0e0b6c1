"""Multi-rank servers over HTTP (real processes on 127.0.0.1): the built-in model at TP=2 against HF;
a mixed workload (grammar, penalties, logprobs, n>1, priority, page_size 16, chunked prefill,
mixed chunk, a small KV pool that forces retraction, the overlap loop) with identical greedy
outputs at TP=1, TP=2 and PP=2; aborts, disconnects and abort_all with every rank's pool back to
full; a two-node launch on one machine; and a killed rank ending the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from server_helpers import Server, start_servers, wait_until  # noqa: E402

from radixserve.testing.tiny_models import hf_greedy  # noqa: E402
from radixserve.utils.network import get_free_port  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# A pool of 512 tokens and an admission that reserves almost nothing for future outputs: the
# workload's concurrent decodes outgrow the pool, so requests are retracted and re-run.
FEATURES = [
    "--page-size", "16", "--chunked-prefill-size", "64", "--enable-mixed-chunk",
    "--enable-priority-scheduling", "--max-total-tokens", "512", "--max-running-requests", "16",
    "--schedule-conservativeness", "0.01",
]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _ranks(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["ranks"]


def _pools(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]["ranks"]


def every_pool_is_full(url: str) -> bool:
    """Every rank idle, every KV slot free or merely cached, every request row free, no leak."""
    pools = _pools(url)
    return all(
        p["available_tokens"] + p["evictable_tokens"] == p["max_total_num_tokens"]
        and p["memory_leak"] is None
        for p in pools
    )


# ----------------------------------------------------------------------------- the built-in model
@pytest.fixture(scope="module")
def builtin_tp2(builtin_model_path: str):
    server = Server.real(builtin_model_path, "--tp-size", "2", "--max-total-tokens", "8192")
    start_servers({"tp2": server})
    yield server
    server.stop()


PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]


@pytest.mark.slow  # make test-all only (docs/testing.md): test_builtin_parity.py (one rank) and the tiny model's TP 2 parity
def test_builtin_model_at_tp2_matches_hf(builtin_tp2: Server, builtin_model_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path)
    hf = AutoModelForCausalLM.from_pretrained(builtin_model_path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0},
            "return_logprob": True,
        }
        out = httpx.post(f"{builtin_tp2.url}/generate", json=body, timeout=120).json()
        ref_ids, ref_logprobs = hf_greedy(hf, ids, 24)
        assert out["output_ids"] == ref_ids, (out["text"], tokenizer.decode(ref_ids))
        got = [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, ref_logprobs)) < 1e-3
    ranks = _ranks(builtin_tp2.url)
    assert [(r["rank"], r["tp_rank"], r["pp_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 0)]
    assert len({r["pid"] for r in ranks}) == 2


# ----------------------------------------------------------------------------- features at TP and PP
@pytest.fixture(scope="module")
def tiny_servers(tiny_model_dir) -> dict[str, Server]:
    path = tiny_model_dir("llama")
    started = {
        "tp1": Server.real(path, *FEATURES, "--enable-overlap-schedule"),
        "tp2": Server.real(path, *FEATURES, "--enable-overlap-schedule", "--tp-size", "2"),
        "pp2": Server.real(path, *FEATURES, "--pp-size", "2"),
    }
    try:
        yield start_servers(started)
    finally:
        for server in started.values():
            server.stop()


def _workload(url: str) -> dict[str, Any]:
    """Concurrent greedy requests of every kind; returns what each produced, keyed by name."""
    prompts = [
        f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 4) for i in range(12)
    ]
    bodies: dict[str, dict[str, Any]] = {}
    for i, text in enumerate(prompts):
        params: dict[str, Any] = {"max_new_tokens": 60 + 20 * (i % 3), "temperature": 0, "ignore_eos": True}
        if i % 4 == 1:
            params["frequency_penalty"], params["presence_penalty"] = 0.7, 0.3
        if i % 4 == 2:
            params["json_schema"] = json.dumps(SCHEMA)
            params.pop("ignore_eos")
        body = {"text": text, "sampling_params": params, "return_logprob": i % 3 == 0, "priority": i % 3}
        bodies[f"r{i}"] = body
    bodies["n2"] = {"text": prompts[0], "sampling_params": {"max_new_tokens": 16, "temperature": 0, "n": 2}}
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        results[name] = httpx.post(f"{url}/generate", json=bodies[name], timeout=300).json()

    threads = [threading.Thread(target=run, args=(name,)) for name in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _same(a: Any, b: Any, name: str) -> None:  # noqa: ANN401
    """Same tokens; logprobs (when asked) within 1e-4."""
    if isinstance(a, list):
        for x, y in zip(a, b, strict=True):
            _same(x, y, name)
        return
    assert a["output_ids"] == b["output_ids"], name
    la, lb = a["meta_info"].get("output_token_logprobs"), b["meta_info"].get("output_token_logprobs")
    assert (la is None) == (lb is None), name
    if la:
        assert max(abs(x[0] - y[0]) for x, y in zip(la, lb, strict=True)) < 1e-4, name


def test_every_feature_gives_the_same_greedy_outputs_at_tp2_and_pp2(tiny_servers: dict[str, Server]) -> None:
    outputs = {name: _workload(server.url) for name, server in tiny_servers.items()}
    for name, out in outputs["tp1"].items():
        assert "error" not in str(out)[:200], out
        _same(outputs["tp2"][name], out, f"tp2 {name}")
        _same(outputs["pp2"][name], out, f"pp2 {name}")
    for i in (2, 6, 10):  # the constrained ones are valid JSON of the schema
        obj = json.loads(outputs["tp2"][f"r{i}"]["text"])
        assert obj["name"] in ("ada", "bob") and 0 <= obj["age"] <= 99
    for server in tiny_servers.values():
        wait_until(lambda s=server: every_pool_is_full(s.url), 10, "every rank's pool to be full")
        state = httpx.get(f"{server.url}/get_server_info").json()["internal_states"][0]
        assert state["num_retracted_reqs"] > 0  # the small pool made decodes retract


@pytest.mark.parametrize(("name", "ranks"), [("tp2", [(0, 0), (1, 0)]), ("pp2", [(0, 0), (0, 1)])])
def test_dashboard_state_has_every_rank(tiny_servers: dict[str, Server], name: str, ranks: list) -> None:
    """Every rank answers the dashboard's request in the same step (a gather): its pool and its
    own batch times, in rank order (docs/observability.md)."""
    url = tiny_servers[name].url
    body = {"text": "dashboard", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 200
    (replica,) = httpx.get(f"{url}/dashboard/state", timeout=30).json()["replicas"]
    assert [(k["tp_rank"], k["pp_rank"]) for k in replica["ranks"]] == ranks
    assert all(k["mean_batch_ms"] is not None and k["max_total_num_tokens"] > 0 for k in replica["ranks"])
    assert replica["num_batches"] > 0 and replica["batches"]


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_aborts_disconnects_and_abort_all_leave_every_rank_full(
    tiny_servers: dict[str, Server], name: str
) -> None:
    url = tiny_servers[name].url
    long = {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0}
    done: list[Any] = []

    def plain(i: int) -> None:
        done.append(
            httpx.post(f"{url}/generate", json={"text": f"long {i}", "sampling_params": long}, timeout=120)
        )

    def disconnecting(i: int) -> None:
        body = {"text": f"stream {i}", "stream": True, "sampling_params": long}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as resp:
            for _ in zip(range(3), resp.iter_lines()):
                pass  # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=plain if i % 2 else disconnecting, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    httpx.post(f"{url}/abort_request", json={"rid": "no-such-request"})
    assert httpx.post(f"{url}/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(timeout=60)
    assert all(r.status_code == 200 for r in done)
    assert all(r.json()["meta_info"]["finish_reason"]["type"] in ("abort", "length") for r in done)
    wait_until(lambda: every_pool_is_full(url), 10, "every rank's pool to be full after abort_all")
    pools = _pools(url)
    assert len(pools) == 2 and len({p["max_total_num_tokens"] for p in pools}) == 1
    assert httpx.post(f"{url}/flush_cache").status_code == 200
    assert all(p["evictable_tokens"] == 0 for p in _pools(url))  # every rank flushed
    out = httpx.post(
        f"{url}/generate", json={"text": "after", "sampling_params": {"max_new_tokens": 4}}
    ).json()
    assert out["meta_info"]["completion_tokens"] == 4


# ----------------------------------------------------------------------------- nodes and failures
def _launch(path: str, log: str, *flags: str) -> tuple[subprocess.Popen, int]:
    port = get_free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--model-path", path, "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--max-total-tokens", "4096", *flags], stdout=out, stderr=subprocess.STDOUT
        )
    return proc, port


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 180) -> None:
    def healthy() -> bool:
        assert proc.poll() is None, "the server exited during start-up"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout, "a healthy server", interval=0.2)


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill_and_watch(victim_pid: int, server: subprocess.Popen, port: int) -> tuple[bool, float]:
    """SIGKILL a rank; return (the server's /health went 503 or away, seconds until it exited)."""
    os.kill(victim_pid, signal.SIGKILL)
    killed, unhealthy = time.monotonic(), False
    while server.poll() is None and time.monotonic() - killed < 30:
        try:
            unhealthy |= httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    took = time.monotonic() - killed
    print(f"killed rank -> server exit: {took:.1f} s")  # docs/parallelism.md quotes it (pytest -s)
    return unhealthy, took


def test_two_nodes_on_one_machine_and_a_killed_rank(tiny_model_dir, tmp_path) -> None:
    path = tiny_model_dir("llama")
    addr = f"127.0.0.1:{get_free_port()}"
    common = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr)
    node0, port0 = _launch(path, str(tmp_path / "node0.log"), *common, "--node-rank", "0")
    node1, port1 = _launch(path, str(tmp_path / "node1.log"), *common, "--node-rank", "1")
    try:
        _wait_healthy(node0, port0)
        _wait_healthy(node1, port1)  # node 1's health endpoint
        body = {"input_ids": [5, 17, 33, 90], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        out = httpx.post(f"http://127.0.0.1:{port0}/generate", json=body, timeout=60).json()
        assert out["meta_info"]["completion_tokens"] == 8
        ranks = _ranks(f"http://127.0.0.1:{port0}")
        assert [(r["rank"], r["node_rank"]) for r in ranks] == [(0, 0), (1, 1)]
        # Kill node 1's rank: node 0 notices through its collectives, reports 503 and exits.
        unhealthy, took = _kill_and_watch(ranks[1]["pid"], node0, port0)
        assert node0.wait(timeout=30) != 0 and node1.wait(timeout=30) != 0
        assert took < 20, took
        log0 = (tmp_path / "node0.log").read_text()
        assert "Rank 0 stops" in log0 and "died" in log0
        assert "died" in (tmp_path / "node1.log").read_text()
    finally:
        _stop(node0, node1)


@pytest.mark.slow  # make test-all only (docs/testing.md): test_two_nodes_on_one_machine_and_a_killed_rank
def test_killed_rank_makes_health_fail_and_the_server_exit(tiny_model_dir, tmp_path) -> None:
    server, port = _launch(tiny_model_dir("llama"), str(tmp_path / "server.log"), "--pp-size", "2")
    try:
        _wait_healthy(server, port)
        victim = _ranks(f"http://127.0.0.1:{port}")[1]["pid"]  # the second pipeline stage
        unhealthy, took = _kill_and_watch(victim, server, port)
        assert server.wait(timeout=30) != 0
        assert unhealthy or took < 2  # it answered 503 until it exited (or exited at once)
        assert took < 20, took
        assert "died" in (tmp_path / "server.log").read_text()
    finally:
        _stop(server)
