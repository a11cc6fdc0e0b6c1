"""SIGTERM drains the real server (entrypoints/drain.py): new requests get 503, in-flight ones run
until --graceful-shutdown-timeout, then end with a final abort event (streams) or a 503 (whole
answers); the process then exits 0 with nothing alarming in its log.

Each test starts its own server on the tiny model, since each one ends it; its steps are slowed
down (/slow_down) so that the requests are surely still running at the SIGTERM and the deadline,
whatever the machine's load."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_helpers import TINY_LONG, internal_state  # noqa: E402
from server_helpers import Server, assert_error, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a loaded 2-core host decodes a few tokens a second

EXIT_BOUND_S = 30.0  # after the deadline: flush the answers, stop uvicorn and the children
CMPL_LONG = {"prompt": "Once upon a time", "max_tokens": TINY_LONG["max_new_tokens"], "ignore_eos": True}
STEP_SLEEP_S = 0.05  # slept before each forward: a TINY_LONG request runs at least 50 s
LOG_ALARMS = ("Traceback", "ZMQError", "Task was destroyed", "timeout graceful shutdown exceeded")


def _start(model_path: str, log: Path, deadline_s: float) -> Server:
    argv = ["-m", "radixserve.launch_server", "--model-path", model_path]
    flags = ["--max-total-tokens", "4096", "--log-level", "info"]
    server = Server([*argv, *flags, "--graceful-shutdown-timeout", str(deadline_s)], log_path=str(log))
    try:
        server.wait_ready(180)
        slowed = httpx.post(f"{server.url}/slow_down", json={"forward_sleep_time": STEP_SLEEP_S}, timeout=30)
        assert slowed.status_code == 200, slowed.text
    except BaseException:
        server.stop()
        raise
    return server


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn` in a daemon thread; its result (or exception) lands in the returned dict."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # reported by the test, not lost in the thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _stream(url: str, path: str, body: dict[str, Any], events: list[str]) -> int:
    """POST a stream; every `data:` payload is appended to `events` as it arrives."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
        return resp.status_code


def _running(url: str) -> int:
    state = internal_state(url)
    return state["num_running_reqs"] + state["num_waiting_reqs"]


def _health_status(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _join(thread: threading.Thread, box: dict[str, Any], timeout: float) -> Any:
    thread.join(timeout)
    assert not thread.is_alive(), "the request did not end"
    if "error" in box:
        raise box["error"]
    return box["result"]


def _assert_quiet_exit(server: Server, log: Path, timeout: float) -> None:
    assert server.proc.wait(timeout=timeout) == 0
    text = log.read_text(errors="replace")
    for alarm in LOG_ALARMS:
        assert alarm not in text, f"{alarm!r} in the server log:\n{text[-4000:]}"


def test_sigterm_aborts_open_requests_at_the_deadline(tiny_llama_path: str, tmp_path: Path) -> None:
    deadline_s = 10.0  # TINY_LONG needs over 50 s slowed down; the checks below take well under a second
    log = tmp_path / "server.log"
    server = _start(tiny_llama_path, log, deadline_s)
    url = server.url
    try:
        cmpl_events: list[str] = []
        native_events: list[str] = []
        cmpl = _in_thread(lambda: _stream(url, "/v1/completions", CMPL_LONG, cmpl_events))
        native = _in_thread(
            lambda: _stream(url, "/generate", {"text": "Once", "sampling_params": TINY_LONG}, native_events)
        )
        whole = _in_thread(
            lambda: httpx.post(
                f"{url}/generate", json={"text": "Hi", "sampling_params": TINY_LONG}, timeout=120
            )
        )
        wait_until(lambda: cmpl_events and native_events and _running(url) == 3, 60, "3 running requests")

        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # Draining: the listener still answers, with 503s that say why.
        wait_until(lambda: _health_status(url) == 503, 10, "/health 503")
        assert "shutting down" in assert_error(httpx.get(f"{url}/health", timeout=5), 503)["message"]
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=10)
        assert "shutting down" in assert_error(late, 503)["message"]

        # At the deadline the open stream ends with an abort chunk, the error and [DONE] ...
        assert _join(*cmpl, timeout=deadline_s + EXIT_BOUND_S) == 200
        assert cmpl_events[-1] == "[DONE]"
        error = json.loads(cmpl_events[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error
        assert json.loads(cmpl_events[-3])["choices"][0]["finish_reason"] == "abort"
        # ... the native stream with its final output (finish_reason abort, 503) and [DONE] ...
        assert _join(*native, timeout=EXIT_BOUND_S) == 200
        assert native_events[-1] == "[DONE]"
        reason = json.loads(native_events[-2])["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 503, reason
        assert "shutting down" in reason["message"]
        # ... and the call waiting for its whole answer gets a 503.
        assert "shutting down" in assert_error(_join(*whole, timeout=EXIT_BOUND_S), 503)["message"]

        _assert_quiet_exit(server, log, max(0.1, deadline_s + EXIT_BOUND_S - (time.monotonic() - signalled)))
    finally:
        server.stop()


def test_sigterm_lets_a_short_request_finish(tiny_llama_path: str, tmp_path: Path) -> None:
    deadline_s = 3600.0  # never reached: the drain must end as soon as the request is done
    log = tmp_path / "server.log"
    server = _start(tiny_llama_path, log, deadline_s)  # 32 steps: at least 1.6 s after the first chunk
    url = server.url
    try:
        events: list[str] = []
        short = {"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True}
        stream = _in_thread(lambda: _stream(url, "/v1/completions", short, events))
        wait_until(lambda: events, 60, "the first chunk")
        server.proc.send_signal(signal.SIGTERM)

        assert _join(*stream, timeout=240) == 200
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length", last
        assert not any("error" in json.loads(e) for e in events[:-1])
        # The server exits once nothing is in flight, long before the deadline.
        _assert_quiet_exit(server, log, EXIT_BOUND_S)
    finally:
        server.stop()
