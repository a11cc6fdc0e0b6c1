"""One benchmarked server as a child process: its own process group, a log file, a /health wait.

The group matters: radixserve forks a scheduler and a detokenizer, and a signal to the group
reaches them all, so no stray process keeps a core busy while the next engine is measured.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from radixserve.utils.network import get_free_port

HEALTH_POLL_S = 0.5


class ServerStartError(RuntimeError):
    """The server exited, or did not answer /health with 200 in time; the message quotes its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (outside the ephemeral range)."""
    return get_free_port()


def log_tail(path: Path, num_lines: int = 30) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-num_lines:])


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The HTTP status of GET `url`, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):
        return None


class ServerProcess:
    """`cmd` run in a new session with stdout+stderr appended to `log_path`; use as a context manager."""

    def __init__(
        self, name: str, cmd: list[str], log_path: Path, base_url: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self.base_url = base_url
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.cmd)}\n".encode())
            log.flush()
            # The child keeps its own copy of the descriptor; ours can close now.
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )

    def wait_healthy(self, timeout_s: float) -> float:
        """Block until GET /health answers 200; returns the seconds waited."""
        assert self.proc is not None, "start() first"
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.proc.returncode} before it was healthy; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if http_status(f"{self.base_url}/health") == 200:
                return time.monotonic() - start
            time.sleep(HEALTH_POLL_S)
        raise ServerStartError(
            f"{self.name} was not healthy after {timeout_s:.0f} s; log {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `timeout_s`; a no-op when already stopped."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        # Children that outlived the leader (rare) still belong to the group.
        self._signal_group(proc.pid, signal.SIGKILL)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def radixserve_server(model: str | None, flags: list[str], log_name: str) -> Iterator[str]:
    """A radixserve server on a free 127.0.0.1 port, healthy, its log in the temp folder as
    `<log_name>_<port>.log`; yields its URL and stops it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), "--log-level", "warning"]
    if model:
        cmd += ["--model-path", model]
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"{log_name}_{port}.log"
    with ServerProcess("radixserve", [*cmd, *flags], log, url) as proc:
        proc.wait_healthy(600)
        yield url
