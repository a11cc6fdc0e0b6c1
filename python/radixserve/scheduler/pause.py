"""Pause / continue generation (SGLang's modes; seed 002 §4.5).

New generate requests are held (by the ControlPlane) until /continue_generation in every mode;
`abort` aborts the live requests (scheduling continues until they are reported), `retract` moves
the running requests back to the waiting queue (freeing their KV) and stops scheduling,
`in_place` stops scheduling and keeps every request and its KV as they are.
"""

from __future__ import annotations

import logging

from radixserve.managers.io_struct import (
    PAUSE_MODES,
    AbortReq,
    ContinueGenerationReqInput,
    ControlOutcome,
    PauseGenerationReqInput,
)
from radixserve.scheduler.activity import Activity
from radixserve.scheduler.requests import RequestTable

logger = logging.getLogger(__name__)


class PauseControl:
    def __init__(self, requests: RequestTable, activity: Activity) -> None:
        self.requests = requests
        self.activity = activity
        self.mode: str | None = None  # one of PAUSE_MODES while paused
        self._retract_pending = False

    @property
    def holds_new_requests(self) -> bool:
        return self.mode is not None

    def stops_scheduling(self) -> bool:
        """Whether no batch may be built now (paused in place / retracted)."""
        return self.mode in ("in_place", "retract")

    def pause_generation(self, msg: PauseGenerationReqInput) -> ControlOutcome:
        if msg.mode not in PAUSE_MODES:
            return ControlOutcome(False, f"mode must be one of {', '.join(PAUSE_MODES)}, got {msg.mode!r}.")
        self.mode = msg.mode
        if msg.mode == "abort":
            self.requests.abort(AbortReq(abort_all=True))
        elif msg.mode == "retract":
            self._retract_pending = True
        logger.info("Generation paused (mode %s)", msg.mode)
        return ControlOutcome(True, f"Generation paused ({msg.mode}).")

    def continue_generation(self, msg: ContinueGenerationReqInput | None = None) -> ControlOutcome:
        """The ControlPlane releases the held requests once this returns."""
        if self.mode is None:
            return ControlOutcome(True, "Generation was not paused.")
        self.mode = None
        self._retract_pending = False
        logger.info("Generation continues")
        return ControlOutcome(True, "Generation continues.")

    def settle_while_stopped(self) -> None:
        """Called instead of building a batch while scheduling is stopped: once no forward is in
        flight, a retract pause moves the running requests back to the queue."""
        st = self.requests.state
        last = st.last_batch
        if last is not None and last.forward_mode.is_extend():
            # The prefill that just ran joins the running batch (as the builder would do).
            exclude = [st.chunked_req] if st.chunked_req is not None else []
            last.filter_batch(chunked_req_to_exclude=exclude)
            st.merge_into_running(last)
            st.last_batch = None
        if not self._retract_pending or self.activity.num_inflight_batches() > 0:
            return
        self._retract_pending = False
        batch = st.running_batch
        batch.filter_batch()
        retracted = [batch.release_req(i) for i in range(len(batch.reqs))]
        batch.filter_batch(keep_indices=[])
        for req in retracted:
            self.requests.requeue(req)
        logger.info("Paused: %d running request(s) retracted to the waiting queue", len(retracted))
