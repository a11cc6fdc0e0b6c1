"""The scheduler's control plane (seed 002 §4.5): the order control requests take effect in,
pause / continue, memory release / resume and weight updates.

Ordering. Requests are dispatched in arrival order, except that an operation that changes what a
forward reads (a weight update, a memory release or resume: `BARRIER_TYPES`) waits until no
forward is in flight and no request is alive (or generation is paused), so in-flight requests
finish on the old weights; with `abort_all_requests` they are aborted instead. Everything that
arrives behind a waiting operation waits with it, except the requests in `BYPASS_TYPES` (aborts,
queries, sessions, pause / continue, operator knobs), which take effect at once.

Pause (SGLang's modes): new generate requests are held until /continue_generation in every mode;
`abort` aborts the live requests (scheduling continues until they are reported), `retract` moves
the running requests back to the waiting queue (freeing their KV) and stops scheduling,
`in_place` stops scheduling and keeps every request and its KV as they are.

Every rank of a multi-rank layout receives the same messages and makes the same decisions here;
outcomes that can differ between ranks (a weight file one rank cannot read) are agreed on through
`RankSync.gather`, so every rank applies or refuses an update alike and rank 0 reports it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from radixserve.managers.io_struct import (
    MEMORY_TAGS,
    PAUSE_MODES,
    AbortReq,
    BatchTokenizedGenerateReqInput,
    CloseSessionReqInput,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    FreezeGCReq,
    GetInternalStateReq,
    GetWeightsByNameReqInput,
    OpenSessionReqInput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    ProfileReq,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    SetInternalStateReq,
    SlowDownReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    rid_matches,
)

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

BARRIER_TYPES = (
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromDistributedReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
)
BYPASS_TYPES = (
    AbortReq,
    OpenSessionReqInput,
    CloseSessionReqInput,
    GetInternalStateReq,
    GetWeightsByNameReqInput,
    PauseGenerationReqInput,
    ContinueGenerationReqInput,
    ProfileReq,
    SlowDownReqInput,
    FreezeGCReq,
    SetInternalStateReq,
)
GENERATE_TYPES = (TokenizedGenerateReqInput, BatchTokenizedGenerateReqInput)
RELEASED_STATUS = int(HTTPStatus.SERVICE_UNAVAILABLE)


class ControlPlane:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.held: deque[object] = deque()  # behind a waiting barrier operation, in arrival order
        self.paused_inputs: list[object] = []  # generate requests that arrived while paused
        self.pause_mode: str | None = None
        self._retract_pending = False
        self._aborted_for: set[int] = set()  # barrier messages whose abort_all was applied
        self.released: set[str] = set()  # MEMORY_TAGS currently released
        self.forward_sleep_time: float | None = None
        self.steps = 0  # scheduler steps so far (the watchdog's progress counter)
        self.waiting_barrier = False

    # ------------------------------------------------------------------ ordering
    def process(self, msgs: list[object], dispatch: Callable[[object], None]) -> None:
        """Dispatch `msgs` (and whatever waits) in order, holding what must wait."""
        self.steps += 1
        for msg in msgs:
            if isinstance(msg, AbortReq) and self.paused_inputs:
                self._admit_aborted(msg, dispatch)
            if self.pause_mode is not None and isinstance(msg, GENERATE_TYPES):
                self.paused_inputs.append(msg)
            elif self.held and isinstance(msg, BYPASS_TYPES):
                dispatch(msg)  # takes effect now, past the waiting operation
                if isinstance(msg, AbortReq):
                    self.held.append(msg)  # also aborts held requests that arrived before it
            else:
                self.held.append(msg)
                self._drain(dispatch)
        self._drain(dispatch)

    def _admit_aborted(self, abort: AbortReq, dispatch: Callable[[object], None]) -> None:
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

    def _drain(self, dispatch: Callable[[object], None]) -> None:
        self.waiting_barrier = False
        while self.held:
            msg = self.held[0]
            if isinstance(msg, BARRIER_TYPES) and not self._ready_for_barrier(msg):
                self.waiting_barrier = True
                return
            self.held.popleft()
            if self.pause_mode is not None and isinstance(msg, GENERATE_TYPES):
                self.paused_inputs.append(msg)
            else:
                dispatch(msg)

    def _ready_for_barrier(self, msg: object) -> bool:
        s = self.s
        if getattr(msg, "abort_all_requests", False) and id(msg) not in self._aborted_for:
            self._aborted_for.add(id(msg))
            logger.info("%s: aborting every request first", type(msg).__name__)
            s.requests.abort(AbortReq(abort_all=True))
        if s.num_inflight_batches > 0:
            return False
        ready = self.quiescent() or self.pause_mode in ("in_place", "retract")
        if ready:
            self._aborted_for.discard(id(msg))
        return ready

    def quiescent(self) -> bool:
        """No request alive and none queued: nothing reads the weights or the KV pool."""
        st = self.s.state
        return st.is_idle() and not st.waiting_queue and self.s.num_inflight_batches == 0

    def has_waiting_work(self) -> bool:
        """A weight update or memory operation (and what arrived behind it) waits to run."""
        return self.waiting_barrier

    def stops_scheduling(self) -> bool:
        """Whether no batch may be built now (paused in place / retracted)."""
        return self.pause_mode in ("in_place", "retract")

    def before_forward(self) -> None:
        if self.forward_sleep_time:
            time.sleep(self.forward_sleep_time)

    # ------------------------------------------------------------------ pause / continue
    def pause_generation(self, msg: PauseGenerationReqInput) -> PauseGenerationReqOutput:
        if msg.mode not in PAUSE_MODES:
            return PauseGenerationReqOutput(
                False, f"mode must be one of {', '.join(PAUSE_MODES)}, got {msg.mode!r}."
            )
        s = self.s
        self.pause_mode = msg.mode
        if msg.mode == "abort":
            s.requests.abort(AbortReq(abort_all=True))
        elif msg.mode == "retract":
            self._retract_pending = True
        logger.info("Generation paused (mode %s)", msg.mode)
        return PauseGenerationReqOutput(True, f"Generation paused ({msg.mode}).")

    def continue_generation(
        self, msg: ContinueGenerationReqInput | None = None
    ) -> ContinueGenerationReqOutput:
        if self.pause_mode is None:
            return ContinueGenerationReqOutput(True, "Generation was not paused.")
        self.pause_mode = None
        self._retract_pending = False
        released, self.paused_inputs = self.paused_inputs, []
        self.held.extendleft(reversed(released))  # ahead of anything that arrived later
        logger.info("Generation continues (%d held request message(s) released)", len(released))
        return ContinueGenerationReqOutput(True, "Generation continues.")

    def settle_while_stopped(self) -> None:
        """Called instead of building a batch while scheduling is stopped: once no forward is in
        flight, a retract pause moves the running requests back to the queue."""
        s = self.s
        st = s.state
        last = st.last_batch
        if last is not None and last.forward_mode.is_extend():
            # The prefill that just ran joins the running batch (as the builder would do).
            exclude = [st.chunked_req] if st.chunked_req is not None else []
            last.filter_batch(chunked_req_to_exclude=exclude)
            st.merge_into_running(last)
            st.last_batch = None
        if not self._retract_pending or s.num_inflight_batches > 0:
            return
        self._retract_pending = False
        batch = st.running_batch
        batch.filter_batch()
        retracted = [batch.release_req(i) for i in range(len(batch.reqs))]
        batch.filter_batch(keep_indices=[])
        for req in retracted:
            s.requests.requeue(req)
        logger.info("Paused: %d running request(s) retracted to the waiting queue", len(retracted))

    # ------------------------------------------------------------------ memory
    def release_memory(self, msg: ReleaseMemoryOccupationReqInput) -> ReleaseMemoryOccupationReqOutput:
        tags, error = self._tags(msg.tags)
        if error is None and not self.quiescent():
            error = "Cannot release memory while requests are alive (paused in place?): abort or finish them first."
        weights = self._weights()
        if error is None and weights is None:
            error = "This worker cannot release memory."
        if error is not None:
            return ReleaseMemoryOccupationReqOutput(False, error)
        before = _rss()
        if "kv_cache" in tags:
            self.s.mem.flush()  # the cached prefixes' KV is about to go
            weights.release_kv_cache()
        if "weights" in tags:
            weights.release_weights()
        self.released.update(tags)
        message = f"Released {', '.join(sorted(tags))}: process RSS {before / 2**20:.0f} -> {_rss() / 2**20:.0f} MiB."
        logger.info(message)
        return ReleaseMemoryOccupationReqOutput(True, message)

    def resume_memory(self, msg: ResumeMemoryOccupationReqInput) -> ResumeMemoryOccupationReqOutput:
        tags, error = self._tags(msg.tags)
        weights = self._weights()
        if error is None and weights is None:
            error = "This worker cannot resume memory."
        if error is not None:
            return ResumeMemoryOccupationReqOutput(False, error)
        ok, message = True, ""
        try:
            if "kv_cache" in tags:
                weights.resume_kv_cache()
            if "weights" in tags:
                weights.resume_weights()
        except Exception as exc:  # e.g. the checkpoint went away: stay released, say why
            logger.exception("Resuming memory failed")
            ok, message = False, f"Resume failed: {exc}"
        ok, message = self.agree(ok, message)
        version = None
        if ok:
            self.released.difference_update(tags)
            message = f"Resumed {', '.join(sorted(tags))}: process RSS {_rss() / 2**20:.0f} MiB."
            if "weights" in tags:
                version = self.s.weight_control.on_weights_reloaded()
                message += f" Weights reloaded from {weights.source_path} (weight_version {version})."
            logger.info(message)
        return ResumeMemoryOccupationReqOutput(ok, message, version)

    def released_message(self) -> str | None:
        if not self.released:
            return None
        return (
            f"The server's memory ({', '.join(sorted(self.released))}) is released: call "
            "/resume_memory_occupation before generating."
        )

    @staticmethod
    def _tags(tags: list[str] | None) -> tuple[set[str], str | None]:
        chosen = set(MEMORY_TAGS if tags is None else tags)
        unknown = sorted(chosen - set(MEMORY_TAGS))
        if unknown:
            return chosen, f"Unknown memory tag(s) {unknown}: use {list(MEMORY_TAGS)} or null for both."
        return chosen, None

    def _weights(self) -> Any:  # noqa: ANN401 - ModelWeights, or None for test workers
        runner = getattr(self.s.worker, "model_runner", None)
        return getattr(runner, "weights", None)

    # ------------------------------------------------------------------ agreement
    def agree(self, ok: bool, message: str) -> tuple[bool, str]:
        """Every rank's outcome: success only if all succeeded, else the first failure's message."""
        outcomes = self.s.sync.gather((ok, message))
        failures = [m for o, m in outcomes if not o]  # type: ignore[misc]
        return (True, message) if not failures else (False, str(failures[0]))


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss
