"""--watchdog-timeout: a scheduler stuck in one step (a forward that never returns, a collective
waiting on a dead peer) is ended rather than left hanging.

A daemon thread watches the scheduler's step counter while the scheduler has work. If the counter
has not moved for `timeout` seconds, it logs every thread's stack (where it is stuck) and ends the
process with exit code 1; the main process's child watch then turns /health unhealthy, fails the
in-flight requests and exits (launch_server.py). An idle scheduler is never fired on.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from radixserve.utils.log_safety import KEEP_LINES

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 1


def format_all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n{stack}")
    return "\n".join(parts)


class SchedulerWatchdog:
    def __init__(
        self,
        timeout_s: float,
        progress: Callable[[], int],
        busy: Callable[[], bool],
        on_fire: Callable[[], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._progress = progress
        self._busy = busy
        self._on_fire = on_fire or _exit_process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler-watchdog", daemon=True)

    def start(self) -> SchedulerWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last, since = self._progress(), time.monotonic()
        poll = min(max(self.timeout_s / 4, 0.05), 5.0)
        while not self._stop.wait(poll):
            now, current = time.monotonic(), self._progress()
            if current != last or not self._busy():
                last, since = current, now
                continue
            if now - since > self.timeout_s:
                logger.error(
                    "Scheduler watchdog: no progress for %.1f s (--watchdog-timeout %.1f s) with work "
                    "in flight. Stacks of every thread:\n%s",
                    now - since,
                    self.timeout_s,
                    format_all_stacks(),
                    extra={KEEP_LINES: True},  # the stacks are the code's own text: keep them readable
                )
                self._on_fire()
                return


def _exit_process() -> None:
    logger.error("Scheduler watchdog: exiting the scheduler process")
    logging.shutdown()
    os._exit(WATCHDOG_EXIT_CODE)
