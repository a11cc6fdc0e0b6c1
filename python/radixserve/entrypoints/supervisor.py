"""The server's children under supervision: a child that dies ends the server (the default), or,
with --restart-on-failure, all children are restarted within a budget (docs/reliability.md).

Every child restarts, not only the dead one: the scheduler's running requests and the
detokenizer's per-request decode state describe the same requests, so a process that survives
would hold state about requests the others no longer know (and with several ranks or data-parallel
replicas, peers blocked in a collective on the dead one). A fresh group starts from one consistent
state: the same ports and arguments, an empty KV pool.

The restarts run on the supervisor's own thread, which lives as long as the children it started:
children ask for SIGKILL when their parent *thread* ends (PR_SET_PDEATHSIG), so a short-lived
thread must never spawn them.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from radixserve.server_args import ServerArgs
from radixserve.utils.process import ChildProcesses

logger = logging.getLogger(__name__)

# Start a new group of children into the given (empty) set; return rank 0's readiness report.
Launch = Callable[[ChildProcesses], tuple[ChildProcesses, dict[str, Any]]]
RESTART_TERMINATE_S = 2.0  # the survivors of a crash get this long to stop before SIGKILL
# Deaths something else caused (an operator, the OOM killer, a container runtime): nothing says a
# request did, so they give the requests in flight no quarantine strike.
KILLED_FROM_OUTSIDE = (-signal.SIGKILL, -signal.SIGTERM)
STOP_WAIT_S = 10.0


class RestartBudget:
    """At most `max_restarts` restarts in any `window_s` seconds (a sliding window)."""

    def __init__(
        self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque()

    @classmethod
    def from_args(cls, server_args: ServerArgs) -> RestartBudget:
        allowed = server_args.max_restarts if server_args.restart_on_failure else 0
        return cls(allowed, server_args.restart_window_minutes * 60.0)

    def try_spend(self) -> bool:
        """Record one restart and return True, or return False when the window's are all spent."""
        now = self._clock()
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    @property
    def used(self) -> int:
        return len(self._times)

    def describe(self) -> str:
        return f"{self.max_restarts} restart(s) per {self.window_s / 60:g} min"


class SupervisorListener(Protocol):
    """What the owner does at each turn; called on the supervisor's thread."""

    def on_down(self, reason: str, blame_requests: bool) -> None:
        """A child died and a restart begins: answer 503, fail what is in flight (giving each a
        quarantine strike if `blame_requests`: the child crashed or ended itself)."""

    def on_up(self, info: dict[str, Any]) -> None:
        """The new children are ready (`info`: rank 0's readiness report): serve again."""

    def on_give_up(self, reason: str) -> None:
        """A child died and no restart is allowed: report unhealthy and exit."""


class Supervisor:
    """Watches the current children and restarts them all while the budget allows."""

    def __init__(self, children: ChildProcesses, launch: Launch, budget: RestartBudget) -> None:
        self._children = children
        self._starting: ChildProcesses | None = None  # the group a restart is starting
        self._launch = launch
        self.budget = budget
        self.listener: SupervisorListener | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._terminated = threading.Event()
        self.last_restart_s: float | None = None  # how long the last restart took
        self._thread = threading.Thread(target=self._run, name="child-supervisor", daemon=True)

    @property
    def children(self) -> ChildProcesses:
        return self._children

    def start(self, listener: SupervisorListener) -> None:
        """Begin watching; `listener` hears of every death, restart and the end."""
        self.listener = listener
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the children (SIGTERM, then SIGKILL after `timeout` s) and the supervision."""
        with self._lock:
            self._stopped.set()
            groups = [self._children, self._starting]
        for group in groups:
            if group is not None:
                group.terminate(timeout)
        self._terminated.set()

    def _run(self) -> None:
        assert self.listener is not None
        while True:
            death = self._children.wait_death()
            if death is None:  # stop(): stay alive (and the children with us) until they are gone
                self._terminated.wait(STOP_WAIT_S)
                return
            reason = f"{death[0]} died (exit code {death[1]})"
            if not self.budget.try_spend():
                if self.budget.max_restarts > 0:
                    logger.error(
                        "%s; the restart budget (%s) is spent: exiting", reason, self.budget.describe()
                    )
                self.listener.on_give_up(reason)
                return
            logger.error(
                "%s; restarting every child process (restart %d of %s); requests in flight end with 503",
                reason,
                self.budget.used,
                self.budget.describe(),
            )
            self.listener.on_down(reason, blame_requests=death[1] not in KILLED_FROM_OUTSIDE)
            if not self._restart(reason):
                return

    def _restart(self, reason: str) -> bool:
        """Replace the children; False when stopped meanwhile or when the budget ran out."""
        assert self.listener is not None
        old = self._children
        old.terminate(RESTART_TERMINATE_S)
        started = time.monotonic()
        while True:
            with self._lock:
                if self._stopped.is_set():
                    return False
                self._starting = starting = ChildProcesses()
            try:
                children, info = self._launch(starting)
            except Exception as exc:
                if self._stopped.is_set():  # stop() ended the start-up
                    return False
                logger.error("Restart failed: %r", exc)
                if not self.budget.try_spend():
                    logger.error("The restart budget (%s) is spent: exiting", self.budget.describe())
                    self.listener.on_give_up(f"{reason}; restarting failed: {exc!r}")
                    return False
                continue
            with self._lock:
                self._starting = None
                if self._stopped.is_set():  # shut down while we started them
                    children.terminate(0.5)
                    return False
                self._children = children
            old.reap()
            self.last_restart_s = time.monotonic() - started
            logger.warning("Child processes restarted in %.1f s; serving again", self.last_restart_s)
            self.listener.on_up(info)
            return True

    def retry_after_s(self, default: float) -> int:
        """Whole seconds a client should wait before retrying: the last restart's duration."""
        return max(1, math.ceil(self.last_restart_s if self.last_restart_s is not None else default))
