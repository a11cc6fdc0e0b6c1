"""The scheduler's limits an operator may change while serving (/set_internal_state).

One object holds them; BatchBuilder (the running cap) and RequestTable (queue cap, timeouts) read
it at every use, so a change made here takes effect at the next step everywhere at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixserve.server_args import ServerArgs

# Knobs /set_internal_state may change while serving (the others are fixed at start).
LIVE_KNOBS = ("max_running_requests", "max_queued_requests", "waiting_timeout", "running_timeout")


@dataclasses.dataclass
class LiveLimits:
    max_running_requests: int
    max_queued_requests: int | None
    waiting_timeout: float | None
    running_timeout: float | None
    # The request rows allocated at start: the most max_running_requests can ever be.
    max_req_num: int
    # Pipeline parallelism: the most requests one micro-batch (one slot's running batch) holds,
    # sized from max_running_requests once, at start; None without pipeline parallelism.
    micro_batch_size: int | None = None

    @classmethod
    def from_server_args(cls, args: ServerArgs, max_req_num: int, pp_size: int) -> LiveLimits:
        running = min(args.max_running_requests or max_req_num, max_req_num)
        timeouts = (args.waiting_timeout, args.running_timeout)
        micro = None
        if pp_size > 1:
            micro = args.pp_max_micro_batch_size or max(running // pp_size, 1)
        return cls(running, args.max_queued_requests, *timeouts, max_req_num, micro)

    @property
    def batch_cap(self) -> int:
        """The most requests the running batch holds: a micro-batch's with pipeline parallelism."""
        return self.micro_batch_size or self.max_running_requests

    def update(self, wanted: dict[str, Any]) -> str | None:
        """Apply `wanted` (knob -> value; None: the start-up default), or change nothing and say
        why not."""
        unknown = sorted(k for k in wanted if k not in LIVE_KNOBS)
        if unknown:
            return f"Only {list(LIVE_KNOBS)} can change while serving, not {unknown}."
        if "max_running_requests" in wanted and self.micro_batch_size is not None:
            return "max_running_requests is fixed per micro-batch with pipeline parallelism."
        error = _check_knobs(wanted, self.max_req_num)
        if error is not None:
            return error
        for key, value in wanted.items():
            if key == "max_running_requests":
                value = value or self.max_req_num
            setattr(self, key, value)
        return None

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in LIVE_KNOBS}


def _check_knobs(wanted: dict[str, Any], max_req_num: int) -> str | None:
    for key, value in wanted.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key} must be a number or null, got {value!r}."
        if key in ("max_running_requests", "max_queued_requests") and (int(value) != value or value < 1):
            return f"{key} must be a positive integer, got {value!r}."
        if key == "max_running_requests" and value > max_req_num:
            return f"max_running_requests is at most {max_req_num} (the request rows allocated at start)."
        if key.endswith("timeout") and value <= 0:
            return f"{key} must be > 0 seconds, got {value!r}."
    return None
