"""The control plane's HTTP routes on a real server with the tiny random Llama: good and bad input
for every route (SGLang's names and answers; 400 for bad input, never a 500), a torch.profiler
trace written by /start_profile + /stop_profile, and the watchdog ending a server whose forward is
slowed past --watchdog-timeout (stacks logged, /health unhealthy, the process exits)."""

from __future__ import annotations

import glob
import gzip
import os
import sys
import threading
import time
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import Server, assert_error, wait_until  # noqa: E402

from radixserve.scheduler.weight_control import serialize_named_tensors  # noqa: E402
from radixserve.testing.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 120, 33, 7, 250]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def server(control_server: Server) -> Server:
    """conftest's server shared with the other control-route file, back on the tiny model's weights."""
    return control_server


def _post(server: Server, route: str, body: Any = None, **kw: Any) -> httpx.Response:  # noqa: ANN401
    return httpx.post(f"{server.url}{route}", json=body, timeout=120, **kw)


def _generate(server: Server, **extra: Any) -> httpx.Response:
    return _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, **extra})


def _state(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/get_server_info", timeout=30).json()["internal_states"][0]


def test_lora_without_enable_lora_is_refused(server: Server) -> None:
    """lora_path used to be ignored silently; without --enable-lora it is a 400 that says so."""
    assert "--enable-lora" in assert_error(_generate(server, lora_path="x"), 400)["message"]
    out = _post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    assert out.status_code == 400 and "--enable-lora" in out.json()["error_message"]


def test_session_routes(server: Server) -> None:
    resp = _post(server, "/open_session", {"capacity_of_str_len": 1000})
    assert resp.status_code == 200
    sid = resp.json()
    assert isinstance(sid, str) and len(sid) == 32
    assert_error(_post(server, "/open_session", {"capacity_of_str_len": 10, "session_id": sid}), 400)
    assert_error(_post(server, "/open_session", {"capacity_of_str_len": "ten"}), 400)
    first = _generate(server, rid="h-1", session_params={"id": sid})
    assert first.status_code == 200
    second = _post(
        server,
        "/generate",
        {"input_ids": [44, 45], "sampling_params": GREEDY, "session_params": {"id": sid, "rid": "h-1"}},
    )
    assert second.status_code == 200
    assert second.json()["meta_info"]["cached_tokens"] == len(PROMPT) + 6 - 1
    assert_error(_generate(server, session_params={"id": sid, "replace": "yes"}), 400)
    assert_error(_generate(server, session_params={"id": "no-such"}), 400)
    assert _post(server, "/close_session", {"session_id": sid}).status_code == 200
    assert_error(_post(server, "/close_session", {"session_id": sid}), 400)
    assert_error(_post(server, "/close_session", {}), 400)


def test_weight_routes(server: Server, tiny_llama_path: str, tmp_path) -> None:
    other = make_tiny_model("llama", tmp_path / "other", seed=5)
    before = _generate(server).json()
    resp = _post(server, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "w2"})
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
    assert set(resp.json()) == {"success", "message", "num_paused_requests"}
    info = httpx.get(f"{server.url}/get_model_info", timeout=30).json()
    assert info["weight_version"] == "w2" and info["model_path"] == str(other)
    after = _generate(server).json()
    assert after["meta_info"]["weight_version"] == "w2" and after["output_ids"] != before["output_ids"]

    bad = _post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "nothing")})
    assert (
        bad.status_code == 400 and bad.json()["success"] is False and "Cannot read" in bad.json()["message"]
    )
    assert_error(_post(server, "/update_weights_from_disk", {"load_format": "auto"}), 400)  # no model_path
    assert _generate(server).json()["output_ids"] == after["output_ids"]  # still serving w2

    got = _post(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4})
    assert got.status_code == 200 and len(got.json()) == 4
    assert_error(_post(server, "/get_weights_by_name", {"name": "model.nope.weight"}), 400)

    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).state_dict()
    body = {"serialized_named_tensors": [serialize_named_tensors(list(sd.items()))], "weight_version": "w3"}
    resp = _post(server, "/update_weights_from_tensor", body)
    assert resp.status_code == 200, resp.text
    assert _generate(server).json()["output_ids"] == before["output_ids"]  # back on the first model
    resp = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]})
    assert resp.status_code == 400 and "cannot be decoded" in resp.json()["message"]
    assert_error(_post(server, "/update_weights_from_tensor", {"serialized_named_tensors": []}), 400)

    group = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 2}
    resp = _post(server, "/init_weights_update_group", {**group, "backend": "mpi"})
    assert resp.status_code == 400 and "backend" in resp.json()["message"]
    assert_error(_post(server, "/init_weights_update_group", {**group, "rank_offset": -1}), 400)
    resp = _post(
        server, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
    )
    assert resp.status_code == 400 and "No weight update group" in resp.json()["message"]
    assert _post(server, "/destroy_weights_update_group", {"group_name": "g"}).status_code == 400
    assert httpx.get(f"{server.url}/update_weights_from_disk", timeout=30).status_code == 405


def test_memory_and_pause_routes(server: Server) -> None:
    assert _post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert_error(_generate(server), 503)
    assert _post(server, "/release_memory_occupation", {"tags": ["disk"]}).status_code == 400
    assert _post(server, "/resume_memory_occupation").status_code == 200  # no body: both tags
    assert _generate(server).status_code == 200

    assert_error(_post(server, "/pause_generation", {"mode": "sometimes"}), 400)
    assert _post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    assert _state(server)["paused"] == "in_place"
    held: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: held.update(r=_generate(server)))
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()  # held while paused
    assert _post(server, "/continue_generation").status_code == 200
    thread.join(60)
    assert held["r"].status_code == 200


def test_operator_routes(server: Server, tmp_path) -> None:
    out_dir = tmp_path / "profile"
    resp = _post(
        server, "/start_profile", {"output_dir": str(out_dir), "profile_id": "run1", "record_shapes": True}
    )
    assert resp.status_code == 200 and resp.text == "Start profiling.\n"
    assert_error(_post(server, "/start_profile", {}), 400)  # already running
    assert _generate(server).status_code == 200
    resp = _post(server, "/stop_profile")
    assert resp.status_code == 200, resp.text
    (trace,) = glob.glob(str(out_dir / "run1-TP-0.trace.json.gz"))
    with gzip.open(trace, "rt") as f:
        content = f.read()
    assert '"traceEvents"' in content and "scheduler_step" in content
    assert_error(_post(server, "/stop_profile"), 400)  # not running
    assert_error(_post(server, "/start_profile", {"activities": ["DISK"]}), 400)
    # num_steps: the trace is written after that many scheduler steps, without /stop_profile.
    resp = _post(server, "/start_profile", {"output_dir": str(out_dir), "profile_id": "run2", "num_steps": 3})
    assert resp.status_code == 200
    _generate(server)
    wait_until(lambda: glob.glob(str(out_dir / "run2-TP-0.trace.json.gz")), 30, "the num_steps trace")

    assert _post(server, "/slow_down", {"forward_sleep_time": 0.05}).status_code == 200
    assert _state(server)["forward_sleep_time"] == 0.05
    assert _post(server, "/slow_down", {"forward_sleep_time": None}).status_code == 200
    assert _post(server, "/slow_down", {"forward_sleep_time": -1}).status_code == 400
    assert _post(server, "/freeze_gc").status_code == 200
    # A dense model without --expert-distribution-recorder-mode: a 400 naming the flag.
    err = assert_error(_post(server, "/start_expert_distribution_record"), 400)
    assert "--expert-distribution-recorder-mode stat" in err["message"]

    resp = _post(server, "/set_internal_state", {"server_args": {"max_running_requests": 4}})
    assert resp.status_code == 200 and resp.json()["updated"] is True
    assert resp.json()["server_args"]["max_running_requests"] == 4
    assert _state(server)["max_running_requests"] == 4
    resp = _post(server, "/set_internal_state", {"server_args": {"page_size": 16}})
    assert resp.status_code == 400 and resp.json()["updated"] is False
    resp = _post(server, "/set_internal_state", {"server_args": {"max_running_requests": 0}})
    assert resp.status_code == 400
    assert (
        _post(server, "/set_internal_state", {"server_args": {"max_running_requests": None}}).status_code
        == 200
    )
    assert _generate(server).status_code == 200


def test_openapi_documents_the_control_routes(server: Server) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    for path in ("/update_weights_from_disk", "/open_session", "/start_profile", "/set_internal_state"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]
    props = doc["components"]["schemas"]["UpdateWeightFromDiskBody"]["properties"]
    assert {"model_path", "load_format", "abort_all_requests", "flush_cache", "weight_version"} <= set(props)
    for path in ("/stop_profile", "/continue_generation", "/freeze_gc", "/resume_memory_occupation"):
        assert "post" in doc["paths"][path]


def test_watchdog_ends_a_stuck_server(tiny_llama_path: str, tmp_path) -> None:
    log = str(tmp_path / "server.log")
    server = Server(
        ["-m", "radixserve.launch_server", "--model-path", tiny_llama_path, "--watchdog-timeout", "2"],
        log_path=log,
    )
    try:
        server.wait_ready()
        time.sleep(3)  # idle past the timeout: the watchdog only watches a scheduler with work
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert _post(server, "/slow_down", {"forward_sleep_time": 10}).status_code == 200
        answer: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: answer.update(r=_generate(server)))
        thread.start()
        statuses: list[int] = []

        def unhealthy() -> bool:
            try:
                statuses.append(httpx.get(f"{server.url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                return server.proc.poll() is not None
            return statuses[-1] == 503

        wait_until(unhealthy, 30, "the server to report unhealthy", interval=0.02)
        thread.join(30)
        assert answer["r"].status_code == 503  # the stuck request is answered, not left hanging
        assert server.proc.wait(30) != 0
        text = open(log).read()
        assert "Scheduler watchdog: no progress" in text and "--- thread" in text
        assert "time.sleep(self.forward_sleep_time)" in text  # the stuck frame is in the dump
    finally:
        server.stop()
