"""--crash-dump-folder end to end, on the tiny model: a scheduler that raises on a marked request
(test-only fault, crashing_scheduler.py) under load leaves a dump with that request and the server
args, no request hangs, and scripts/replay_crash_dump.py reproduces the crash on a fresh server with
the same fault while a server without it answers the replay."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading

import httpx
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from crashing_scheduler import CRASH_HOW_ENV, CRASH_MARKER_ENV  # noqa: E402
from server_helpers import Server, start_servers, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(600)

REPLAY = os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts", "replay_crash_dump.py")
MARKER = "XYZZY"
FAULT = {CRASH_MARKER_ENV: MARKER, CRASH_HOW_ENV: "raise"}
NUM_LOAD = 3
LOAD_PARAMS = {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}  # running at the crash


def _server(model: str, env: dict[str, str], *flags: str) -> Server:
    script = os.path.join(HERE, "crashing_scheduler.py")
    return Server([script, "--model-path", model, "--max-total-tokens", "8192", *flags], env=env)


@pytest.fixture(scope="module")
def crash_servers(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory):
    dumps = str(tmp_path_factory.mktemp("dumps"))
    started = {
        "crashing": _server(tiny_llama_path, FAULT, "--crash-dump-folder", dumps),
        "replay_crashing": _server(tiny_llama_path, FAULT),
    }
    try:
        yield start_servers(started), dumps
    finally:
        for server in started.values():
            server.stop()


class Stream(threading.Thread):
    """One streaming /generate; its data lines, or the error that ended it."""

    def __init__(self, url: str, i: int) -> None:
        super().__init__(daemon=True)
        self.body = {"rid": f"load-{i}", "text": f"Story number {i}:", "stream": True}
        self.body["sampling_params"] = LOAD_PARAMS
        self.url = url
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/generate", json=self.body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _replay(dump: str, url: str) -> tuple[int, list[dict]]:
    out = subprocess.run(
        [sys.executable, REPLAY, dump, "--url", url, "--speed", "10", "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.returncode, [json.loads(line) for line in out.stdout.splitlines()]


def test_crash_dump_is_written_and_replays_the_crash(crash_servers, tiny: str) -> None:
    """`tiny`: the session's healthy tiny-model server (conftest.py) answers the replay."""
    (by_name, dumps) = crash_servers
    crashing = by_name["crashing"]
    streams = [Stream(crashing.url, i) for i in range(NUM_LOAD)]
    for stream in streams:
        stream.start()
    wait_until(lambda: all(s.events for s in streams), 60, "every load stream's first tokens")
    body = {"rid": "poison", "text": f"please {MARKER} now", "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(f"{crashing.url}/generate", json=body, timeout=60)
    assert r.status_code == 503, r.text  # the marked request fails, it does not hang
    for stream in streams:  # neither does any other request in flight
        stream.join(30)
        assert not stream.is_alive() and stream.error is None, stream.error
        reason = json.loads(stream.events[-2])["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 503, reason
    assert crashing.proc.wait(30) == 1  # without --restart-on-failure the server exits

    (path,) = glob.glob(os.path.join(dumps, "crash_dump_*.json"))
    with open(path) as f:
        dump = json.load(f)
    assert dump["format"] == "radixserve-crash-dump" and "exit code 1" in dump["reason"]
    assert dump["server_args"]["crash_dump_folder"] == dumps
    requests = {r["rid"]: r for r in dump["requests"]}
    assert MARKER in requests["poison"]["input_text"] and requests["poison"]["in_flight"]
    assert requests["poison"]["sampling_params"]["max_new_tokens"] == 4
    assert all(requests[f"load-{i}"]["in_flight"] for i in range(NUM_LOAD))
    assert [r["rid"] for r in dump["requests"]][-1] == "poison"  # in the order received
    assert all(r["input_ids"] for r in dump["requests"])

    code, results = _replay(path, by_name["replay_crashing"].url)
    assert code == 1
    failed = {r["rid"] for r in results[:-1] if r["status"] != 200}
    assert "poison" in failed and results[-1]["num_failed"] == len(failed)
    assert by_name["replay_crashing"].proc.wait(30) == 1  # the same crash

    code, results = _replay(path, tiny)
    assert code == 0, results
    assert {r["rid"] for r in results[:-1]} == set(requests)
    assert all(r["status"] == 200 for r in results[:-1])
