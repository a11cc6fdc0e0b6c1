"""The scheduler's request bookkeeping: the waiting queue, the running batch, the chunked request and
a rid -> Req table of every live request; admission checks, abort by rid prefix and timeouts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field, replace
from http import HTTPStatus

from radixserve.distributed.rank_runtime import LocalSync, RankSync
from radixserve.managers.io_struct import (
    AbortReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    rid_matches,
)
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.live_limits import LiveLimits
from radixserve.scheduler.output_processor import OutputProcessor
from radixserve.scheduler.req import FinishAbort, Req
from radixserve.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

QUEUE_FULL = "The request queue is full."


@dataclass
class SchedulerState:
    """Seed 001 §11.5's running status."""

    running_batch: ScheduleBatch
    new_token_ratio: float
    waiting_queue: list[Req] = field(default_factory=list)
    chunked_req: Req | None = None
    last_batch: ScheduleBatch | None = None
    live: dict[str, Req] = field(default_factory=dict)  # every request not yet reported finished
    # Requests decoding in the other micro-batches of a pipeline stage (event_loop_pp): admission
    # reserves their future KV as it does the running batch's.
    other_running_reqs: list[Req] = field(default_factory=list)

    def is_idle(self) -> bool:
        return not self.live and self.running_batch.is_empty() and self.chunked_req is None

    def merge_into_running(self, batch: ScheduleBatch) -> None:
        """Its requests decode from the next step on (a prefill that ran, a PREBUILT batch);
        `batch` is filtered already."""
        if batch.is_empty():
            return
        if self.running_batch.is_empty():
            self.running_batch = batch
        else:
            self.running_batch.merge_batch(batch)


class RequestTable:
    def __init__(
        self,
        state: SchedulerState,
        output: OutputProcessor,
        limits: LiveLimits,  # queue cap and timeouts, read at each use
        max_req_len: int,  # prompt + output must fit this (min of context length and KV pool size)
        sync: RankSync | None = None,
        loras: Container[str] = (),  # the loaded LoRA adapters' ids (the worker's, live)
        takes_images: bool = False,  # the model has a vision tower
    ) -> None:
        self.state = state
        self.loras = loras
        self.takes_images = takes_images
        self.output = output
        self.limits = limits
        self.max_req_len = max_req_len
        # Timeouts read each rank's clock: ranks agree on which expired (any rank's view wins).
        self.sync: RankSync = sync or LocalSync()
        self.arrived: list[Req] = []  # accepted since the last enforce_queue_cap, in arrival order

    # ------------------------------------------------------------------ arrival
    def add(self, req: Req, enqueue: Callable[[Req], None] | None = None) -> None:
        """Validate and enqueue (through `enqueue` when given, e.g. the grammar queue's router); a
        request that can never run is finished at once with the reason. The queue cap is applied
        once this step's batch is built (enforce_queue_cap)."""
        self.state.live[req.rid] = req
        error = self._validate(req)
        if error is not None:
            self.output.finish_now(req, error, int(HTTPStatus.BAD_REQUEST))
            return
        self.arrived.append(req)
        (enqueue or self.enqueue)(req)

    def enforce_queue_cap(self, grammar_queue: list[Req]) -> None:
        """--max-queued-requests, right after the step's batch was built: requests still waiting,
        in the waiting queue or in the grammar queue (compiling), count against the cap; those the
        batch admitted do not. Beyond the cap, this step's arrivals are refused (503): the lowest
        priority first, then the newest; requests accepted in an earlier step never are.
        So a burst to an idle server is refused only for what the running batch cannot take now,
        and a flood of constrained requests cannot pile up while their grammars compile."""
        arrived, self.arrived = self.arrived, []
        cap = self.limits.max_queued_requests
        if cap is None or not arrived:
            return
        waiting = self.state.waiting_queue
        excess = len(waiting) + len(grammar_queue) - cap
        if excess <= 0:
            return
        queued = {id(r) for r in waiting} | {id(r) for r in grammar_queue}
        candidates = [r for r in arrived if id(r) in queued and not r.finished()]
        # Last in the list = first refused: the lowest priority, then the newest arrival (stable).
        candidates.sort(key=lambda r: -r.priority)
        refused = candidates[len(candidates) - min(excess, len(candidates)) :]
        refused_ids = {id(r) for r in refused}
        waiting[:] = [r for r in waiting if id(r) not in refused_ids]
        compiling = {id(r) for r in grammar_queue}
        for req in refused:
            if id(req) in compiling:
                # Finished by the grammar queue at its next check, like an abort while compiling.
                req.to_finish = FinishAbort(QUEUE_FULL, int(HTTPStatus.SERVICE_UNAVAILABLE))
            else:
                self.output.finish_now(req, QUEUE_FULL, int(HTTPStatus.SERVICE_UNAVAILABLE))

    def _validate(self, req: Req) -> str | None:
        input_len, max_len = len(req.origin_input_ids), self.max_req_len
        if input_len == 0:
            return "The input is empty: at least one token is needed."
        if req.lora_id is not None and req.lora_id not in self.loras:
            # The TokenizerManager refuses these first; an in-process caller may not have.
            return f"LoRA adapter {req.lora_id!r} is not loaded (or the server runs without --enable-lora)."
        if req.multimodal_inputs is not None and not self.takes_images:
            # The TokenizerManager refuses these first; the pad values would crash a text model.
            return "'image_data' is not supported: this server runs a text-only model."
        if req.is_embedding and input_len <= max_len:
            return None  # nothing is generated: the whole context is the prompt's
        if input_len >= max_len:
            return (
                f"The input ({input_len} tokens) is longer than the model's context length or the KV "
                f"cache allows ({max_len} tokens, which must include at least one output token)."
            )
        # Cap the output so prompt + output fits the context and the KV pool even alone: a request
        # that cannot finish would otherwise be retracted forever.
        room = max_len - 1 - input_len
        if req.sampling_params.max_new_tokens > room:
            req.sampling_params = replace(req.sampling_params, max_new_tokens=max(room, 1))
        return None

    def enqueue(self, req: Req) -> None:
        req.times.queued = time.monotonic()
        self.state.waiting_queue.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted or preempted request goes back to the queue, unless it was aborted meanwhile."""
        if req.to_finish is not None:
            reason, req.to_finish = req.to_finish, None
            req.finished_reason = reason
            self.output.collect(req)
            return
        self.enqueue(req)

    def forget(self, req: Req) -> None:
        """Called once the request's final output was sent."""
        if self.state.live.get(req.rid) is req:
            del self.state.live[req.rid]

    # ------------------------------------------------------------------ abort
    def abort(self, msg: AbortReq) -> None:
        """Abort the live request msg.rid and its n > 1 children "rid-i" (or all), in any state.

        See io_struct.rid_matches for which rids a target covers."""
        matches = [r for rid, r in self.state.live.items() if msg.abort_all or rid_matches(rid, msg.rid)]
        for req in matches:
            self.abort_req(req, "Aborted by AbortReq.")

    def abort_req(self, req: Req, message: str, status_code: int | None = None) -> None:
        if req.finished():
            return
        waiting = self.state.waiting_queue
        if any(r is req for r in waiting):
            waiting[:] = [r for r in waiting if r is not req]
            logger.debug("Abort queued request %s", req.rid)
            self.output.finish_now(req, message, status_code)
        else:
            # Running, chunked or in a launched batch: finished safely at its next result processing
            # (the chunked request when the next batch is built).
            req.to_finish = FinishAbort(message, status_code)

    def abort_on_timeouts(self) -> None:
        now = time.monotonic()
        if self.limits.waiting_timeout is not None:
            waiting = list(self.state.waiting_queue)
            flags = self.sync.any_rank([now - r.times.queued > self.limits.waiting_timeout for r in waiting])
            expired = [r for r, flag in zip(waiting, flags) if flag]
            for req in expired:
                self.abort_req(
                    req,
                    f"Request waited longer than the waiting timeout ({self.limits.waiting_timeout} s).",
                    int(HTTPStatus.SERVICE_UNAVAILABLE),
                )
        if self.limits.running_timeout is not None:
            running = list(self.state.running_batch.reqs)
            if self.state.chunked_req is not None:
                running.append(self.state.chunked_req)
            started = [r.times.first_scheduled for r in running]
            flags = self.sync.any_rank(
                [t is not None and now - t > self.limits.running_timeout for t in started]
            )
            for req, flag in zip(running, flags):
                if flag:
                    self.abort_req(
                        req, f"Request ran longer than the running timeout ({self.limits.running_timeout} s)."
                    )

    @staticmethod
    def build_embedding_req(msg: TokenizedEmbeddingReqInput, needs_all_tokens: bool) -> Req:
        params = SamplingParams(max_new_tokens=0)
        params.normalize()
        req = Req(
            TokenizedGenerateReqInput(
                msg.rid,
                msg.input_text,
                msg.input_ids,
                params,
                priority=msg.priority,
                received_time=msg.received_time,
            )
        )
        req.is_embedding = True
        req.token_type_ids, req.label_token_ids = msg.token_type_ids, msg.label_token_ids
        # Scoring reads the last position only, whatever the model's pooling.
        req.needs_all_tokens = needs_all_tokens and msg.label_token_ids is None
        return req
