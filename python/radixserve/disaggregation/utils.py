"""Modes, transfer states and the small types both sides of a disaggregated pair share."""

from __future__ import annotations

import threading
import time
from enum import Enum, IntEnum

# A request whose bootstrap_host is this moves no KV whatever the backend (SGLang's warm-up and
# health-probe convention): both sides finish it on their own.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"

# The status code of a transfer failed by an abort (either side's): the request ends as an abort,
# not as a server error.
ABORTED_STATUS = 499


class DisaggregationMode(str, Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVPoll(IntEnum):
    """A transfer's state (SGLang's values). On the prefill side: Bootstrapping until the decode
    side has allocated and said so, WaitingForInput until the KV is computed, Transferring until
    the decode side acknowledges it. On the decode side: Bootstrapping until the prefill server's
    bootstrap answered, WaitingForInput until our pages are allocated, Transferring until the KV
    arrived."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = (KVPoll.Success, KVPoll.Failed)


class TransferStatus:
    """One transfer's status, shared by the scheduler thread and a backend's I/O thread.

    It only moves forward; Failed wins over any state that is not final, and a final state
    (Success or Failed) never changes, so a late message cannot revive or re-fail a request."""

    def __init__(self, timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._status = KVPoll.Bootstrapping
        self.error: str | None = None
        self.error_status_code = 503
        self.timeout_s = timeout_s
        self.phase_started = time.monotonic()  # the timeout counts per phase

    def poll(self) -> KVPoll:
        return self._status

    def advance(self, status: KVPoll) -> bool:
        """Move forward to `status`; False (nothing changed) if that is not forward."""
        with self._lock:
            if self._status in TERMINAL or status <= self._status or status == KVPoll.Failed:
                return False
            self._status = status
            self.phase_started = time.monotonic()
            return True

    def fail(self, message: str, status_code: int = 503) -> bool:
        with self._lock:
            if self._status in TERMINAL:
                return False
            self._status = KVPoll.Failed
            self.error = message
            self.error_status_code = status_code
            return True

    def expired(self, now: float) -> bool:
        return self._status not in TERMINAL and now - self.phase_started > self.timeout_s


def error_status(code: int | None) -> int | None:
    """The status code a failed transfer's request finishes with (None: a plain abort)."""
    return None if code == ABORTED_STATUS else code


def is_fake(bootstrap_host: str | None, backend: str) -> bool:
    return backend == "fake" or bootstrap_host == FAKE_BOOTSTRAP_HOST
