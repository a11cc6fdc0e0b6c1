"""What the control add-ons may ask about the scheduler's work: is a forward in flight, is any
request alive. A narrow view, so that pause, weight updates and memory release need not hold the
Scheduler."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.scheduler.requests import SchedulerState


class Activity:
    def __init__(self, state: SchedulerState, num_inflight_batches: Callable[[], int]) -> None:
        self._state = state
        self._num_inflight_batches = num_inflight_batches

    def num_inflight_batches(self) -> int:
        """Batches launched whose results are not processed yet."""
        return self._num_inflight_batches()

    def quiescent(self) -> bool:
        """No request alive and none queued: nothing reads the weights or the KV pool."""
        st = self._state
        return st.is_idle() and not st.waiting_queue and self._num_inflight_batches() == 0
