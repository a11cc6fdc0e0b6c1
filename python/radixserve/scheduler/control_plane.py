"""ControlPlane: the one place that holds the scheduler's incoming messages, and the order in
which they take effect (seed 002 §4.5).

Three holds, applied in this order to each step's messages:

1. BLOCK / UNBLOCK (SchedulerInputBlocker): while blocked, everything is held until every rank
   has unblocked.
2. Barriers: requests are dispatched in arrival order, except that an operation that changes what
   a forward reads (a weight update, a memory release or resume: `Ordering.BARRIER`) waits until
   no forward is in flight and no request is alive (or generation is paused), so in-flight
   requests finish on the old weights; with `abort_all_requests` they are aborted instead.
   Everything that arrives behind a waiting operation waits with it, except `Ordering.BYPASS`
   requests (aborts, queries, sessions, pause / continue, operator knobs), which take effect at
   once. Each request class declares its ordering (managers/control_messages.py).
3. Pause: while generation is paused (PauseControl), new generate requests are held until it
   continues; an abort admits the held requests it targets, so they finish at once.

Every rank of a multi-rank layout receives the same messages and makes the same decisions here.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from radixserve.managers.io_struct import (
    AbortReq,
    BatchTokenizedGenerateReqInput,
    ControlReq,
    Ordering,
    TokenizedGenerateReqInput,
    rid_matches,
)
from radixserve.scheduler.activity import Activity
from radixserve.scheduler.input_blocker import SchedulerInputBlocker
from radixserve.scheduler.pause import PauseControl
from radixserve.scheduler.requests import RequestTable

logger = logging.getLogger(__name__)

GENERATE_TYPES = (TokenizedGenerateReqInput, BatchTokenizedGenerateReqInput)


def ordering(msg: object) -> Ordering:
    """A control request's declared ordering; every other message (generation) is in order."""
    return msg.ordering if isinstance(msg, ControlReq) else Ordering.IN_ORDER


Dispatch = Callable[[object], None]


class ControlPlane:
    def __init__(
        self, blocker: SchedulerInputBlocker, requests: RequestTable, activity: Activity, pause: PauseControl
    ) -> None:
        self.blocker = blocker
        self.requests = requests
        self.activity = activity
        self.pause = pause
        self.held: deque[object] = deque()  # behind a waiting barrier operation, in arrival order
        self.paused_inputs: list[object] = []  # generate requests that arrived while paused
        self._aborted_for: set[int] = set()  # barrier messages whose abort_all was applied
        self.waiting_barrier = False

    def process(self, recv_reqs: Iterable[object], dispatch: Dispatch) -> None:
        """Dispatch this step's messages (and whatever waits) in order, holding what must wait."""
        for msg in self.blocker.handle(list(recv_reqs)) or []:
            if isinstance(msg, AbortReq) and self.paused_inputs:
                self._admit_aborted(msg, dispatch)
            if self.pause.holds_new_requests and isinstance(msg, GENERATE_TYPES):
                self.paused_inputs.append(msg)
            elif self.held and ordering(msg) is Ordering.BYPASS:
                self._dispatch(msg, dispatch)  # takes effect now, past the waiting operation
                if isinstance(msg, AbortReq):
                    self.held.append(msg)  # also aborts held requests that arrived before it
            else:
                self.held.append(msg)
                self._drain(dispatch)
        self._drain(dispatch)

    def has_waiting_work(self) -> bool:
        """Held work the loop must keep stepping for: a weight update or memory operation (and
        what arrived behind it), or the UNBLOCK barrier (polled every step)."""
        return self.waiting_barrier or self.blocker.at_barrier

    def _dispatch(self, msg: object, dispatch: Dispatch) -> None:
        dispatch(msg)
        if self.paused_inputs and not self.pause.holds_new_requests:  # generation continued
            released, self.paused_inputs = self.paused_inputs, []
            self.held.extendleft(reversed(released))  # ahead of anything that arrived later
            logger.info("%d request message(s) held by the pause released", len(released))

    def _admit_aborted(self, abort: AbortReq, dispatch: Dispatch) -> None:
        """Requests held by a pause that `abort` targets are admitted now, so the abort finishes
        them (and their callers get their final output) without waiting for continue."""

        def targeted(msg: object) -> bool:
            reqs = msg.reqs if isinstance(msg, BatchTokenizedGenerateReqInput) else [msg]
            return any(abort.abort_all or rid_matches(r.rid, abort.rid) for r in reqs)  # type: ignore[attr-defined]

        keep = []
        for msg in self.paused_inputs:
            if targeted(msg):
                dispatch(msg)
            else:
                keep.append(msg)
        self.paused_inputs = keep

    def _drain(self, dispatch: Dispatch) -> None:
        self.waiting_barrier = False
        while self.held:
            msg = self.held[0]
            if ordering(msg) is Ordering.BARRIER and not self._ready_for_barrier(msg):
                self.waiting_barrier = True
                return
            self.held.popleft()
            if self.pause.holds_new_requests and isinstance(msg, GENERATE_TYPES):
                self.paused_inputs.append(msg)
            else:
                self._dispatch(msg, dispatch)

    def _ready_for_barrier(self, msg: object) -> bool:
        if getattr(msg, "abort_all_requests", False) and id(msg) not in self._aborted_for:
            self._aborted_for.add(id(msg))
            logger.info("%s: aborting every request first", type(msg).__name__)
            self.requests.abort(AbortReq(abort_all=True))
        if self.activity.num_inflight_batches() > 0:
            return False
        ready = self.activity.quiescent() or self.pause.stops_scheduling()
        if ready:
            self._aborted_for.discard(id(msg))
        return ready
