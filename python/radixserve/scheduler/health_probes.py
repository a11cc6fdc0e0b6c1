"""Health probes that never queue behind work (the seeds' return_health_check_ct).

/health_generate sends a 1-token probe when the server has produced no output for a while. On an
idle scheduler the probe runs like any request. On a busy one it would wait behind the batch, or
be refused when --max-queued-requests is reached, and a load balancer would take a busy server for
a dead one. Here a probe that arrives while the scheduler has work is not queued: it is kept aside
and answered (finished with no token) by the next batch result, which is the proof the probe
looks for: the model is producing outputs.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.managers.io_struct import FinishLength
from radixserve.scheduler.req import Req


class HealthProbes:
    def __init__(self, live: dict[str, Req], collect: Callable[[Req], None]) -> None:
        self.live = live  # the scheduler's rid -> Req table (an abort of the probe finds it)
        self.collect = collect  # OutputProcessor.collect: sent with the step's output message
        self.deferred: list[Req] = []

    def defer(self, req: Req) -> None:
        """Hold a probe that arrived while the scheduler is busy, instead of queueing it."""
        self.live[req.rid] = req
        self.deferred.append(req)

    def answer(self) -> None:
        """A batch result came back: every held probe is answered."""
        probes, self.deferred = self.deferred, []
        for req in probes:
            if req.finished():
                continue
            req.finished_reason = req.to_finish or FinishLength(0)  # an abort that came first wins
            self.collect(req)
