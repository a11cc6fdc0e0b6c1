"""Helpers shared by the HTTP server tests: start a server on a free port, read SSE, check errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from radixserve.utils.network import get_free_port

HERE = os.path.dirname(os.path.abspath(__file__))
# KV pool sizes of the real-model servers and Engines: small, so a leak shows quickly.
TINY_POOL_TOKENS = 16384
FIELDS_CHUNK = 16  # conftest's fields_engine prefills prompts longer than this in chunks
BUILTIN_POOL_TOKENS = 8192
FAKE_API_KEY = "sk-test"  # conftest's fake_servers["auth"]


class Server:
    """A server process on a free port: the fake-scheduler script or the real launch_server."""

    def __init__(
        self, argv: list[str], env: dict[str, str] | None = None, log_path: str | None = None
    ) -> None:
        """`log_path`: write the server's output there (pass --log-level in argv to see more)."""
        self.port = get_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        level = [] if "--log-level" in argv else ["--log-level", "warning"]
        cmd = [sys.executable, *argv, "--port", str(self.port), *level]
        out = open(log_path, "w") if log_path else None  # noqa: SIM115 - the child writes it until stop()
        self.proc = subprocess.Popen(
            cmd, env=dict(os.environ, **(env or {})), stdout=out, stderr=subprocess.STDOUT if out else None
        )
        if out is not None:
            out.close()  # the child holds its own descriptor

    @classmethod
    def fake(cls, tok_dir: str, *flags: str, step_s: float = 0.01, log_path: str | None = None) -> Server:
        """The real HTTP server with test/server/fake_scheduler.py in place of the scheduler."""
        script = os.path.join(HERE, "fake_scheduler.py")
        return cls(
            [script, "--model-path", tok_dir, *flags], env={"FAKE_STEP_S": str(step_s)}, log_path=log_path
        )

    @classmethod
    def real(cls, model_path: str, *flags: str) -> Server:
        """`python -m radixserve.launch_server --model-path ... <flags>`."""
        return cls(["-m", "radixserve.launch_server", "--model-path", model_path, *flags])

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "server exited during start-up"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_servers(servers: dict[str, Server], timeout: float = 180.0) -> dict[str, Server]:
    """Wait for servers started together (their start-ups overlap); stop them all on failure."""
    try:
        for server in servers.values():
            server.wait_ready(timeout)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


class SharedServers:
    """Servers that several test files share (a session fixture holds one): each starts on its
    first use, and again after a test ended it (a lifecycle test's SIGTERM or SIGKILL)."""

    def __init__(self, makers: dict[str, Callable[[], Server]], timeout: float = 180.0) -> None:
        self._makers = makers
        self._timeout = timeout  # start_servers' bound on each start
        self._live: dict[str, Server] = {}

    def get(self, *names: str) -> dict[str, Server]:
        """The named servers, running; those not running are started together."""
        dead = [n for n in names if n not in self._live or self._live[n].proc.poll() is not None]
        self._live.update(start_servers({n: self._makers[n]() for n in dead}, self._timeout))
        return {n: self._live[n] for n in names}

    def stop(self) -> None:
        for server in self._live.values():
            server.stop()

    def stop_after_last_user(self, item: pytest.Item, fixture: str) -> None:
        """Stop the servers once `item` was the run's last test using `fixture` (idle, they would
        hold their memory through every later test; a later `get` would start them again)."""
        if fixture not in item.fixturenames:
            return
        items = item.session.items
        if not any(fixture in later.fixturenames for later in items[items.index(item) + 1 :]):
            self.stop()


# The session fixtures (by name) whose servers stop after their last user: see held_by_fixture.
_STOPPED_AFTER_LAST_USER: dict[str, SharedServers] = {}


@contextmanager
def held_by_fixture(shared: SharedServers, fixture: str) -> Iterator[SharedServers]:
    """For the session fixture named `fixture`: `shared`, stopped after the last test that uses it
    (by stop_after_last_users, which that conftest names its pytest_runtest_teardown) and at the
    session's end in any case."""
    _STOPPED_AFTER_LAST_USER[fixture] = shared
    try:
        yield shared
    finally:
        shared.stop()
        del _STOPPED_AFTER_LAST_USER[fixture]


@pytest.hookimpl(trylast=True)  # after the item's own fixtures (a router in front) are torn down
def stop_after_last_users(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A conftest's `pytest_runtest_teardown = stop_after_last_users`: each held_by_fixture server
    set stops once `item` was its fixture's last user."""
    for fixture, shared in _STOPPED_AFTER_LAST_USER.items():
        shared.stop_after_last_user(item, fixture)


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]


def assert_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error"), err
    return err


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `check()` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)
