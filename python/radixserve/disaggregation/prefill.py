"""The prefill side of a disaggregated pair (seed INVENTORY §33).

A request waits in the PrefillBootstrapQueue until its decode server has bootstrapped and
allocated its pages (KVPoll.WaitingForInput), is prefilled by the usual batch builder (radix
cache, chunking, admission), then waits in the inflight queue while its KV and first token go
out; on the decode side's acknowledgement its KV is released (the prompt stays in the radix tree)
and the request finishes here with that one token. Nothing here ever decodes. The queues are hooks
of the usual loop (scheduler/loops.py: LoopHooks).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from http import HTTPStatus
from typing import Any

from radixserve.disaggregation import wire
from radixserve.disaggregation.backend import FakeSender, KVSender
from radixserve.disaggregation.bootstrap_server import BootstrapServer, RoomRegistrar
from radixserve.disaggregation.common import (
    WILDCARD_HOSTS,
    Agreed,
    SideParts,
    admit_pd,
    advertised_host,
    agree,
)
from radixserve.disaggregation.mooncake_engine import MooncakeEngine
from radixserve.disaggregation.tcp_prefill import PrefillTcpManager, ReplicaInfo
from radixserve.disaggregation.utils import KVPoll, error_status, is_fake
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.model_executor.forward_batch import GenerationBatchResult
from radixserve.scheduler.loops import BatchResult, LoopHooks
from radixserve.scheduler.output_processor import INVALID_TOKEN_MESSAGE, OutputProcessor
from radixserve.scheduler.req import FinishLength, Req
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.server_args import resolve_load_balance_method

logger = logging.getLogger(__name__)


class PrefillBootstrapQueue:
    """Requests whose decode side has not bootstrapped yet; they hold no KV."""

    def __init__(self, side: PrefillDisaggregation) -> None:
        self.side = side
        self.queue: list[Req] = []

    def add(self, req: Req) -> None:
        self.side.senders[id(req)] = self.side.create_sender(req)
        self.side.owners[id(req)] = req
        self.queue.append(req)

    def pop_bootstrapped(self) -> None:
        """Bootstrapped requests (on every rank) join the waiting queue; failed or aborted ones
        finish."""
        side, keep = self.side, []
        agreed = agree(side.parts.sync, [side.senders[id(req)] for req in self.queue])
        for req, status in zip(self.queue, agreed):
            if req.to_finish is not None:
                side.abort(req)
            elif status.status == KVPoll.Failed:
                side.finish_agreed_failure(req, status)
            elif status.status >= KVPoll.WaitingForInput:
                side.parts.requests.enqueue(req)
            else:
                keep.append(req)
        self.queue = keep


class PrefillDisaggregation(LoopHooks):
    def __init__(self, parts: SideParts) -> None:
        args = parts.args
        self.parts = parts
        self.backend = args.disaggregation_transfer_backend
        self.timeout_s = args.disaggregation_bootstrap_timeout
        self.pool = parts.kv_pool
        self.layout = parts.layout
        host = advertised_host(args.host)
        method = resolve_load_balance_method(args.load_balance_method, args.disaggregation_mode)
        self.replicas = ReplicaInfo(parts.dp_rank, args.dp_size, method)
        # Replica 0's TP rank 0 serves the bootstrap routes; every rank of every replica registers
        # its own KV sender there.
        self.bootstrap_server = (
            BootstrapServer(args.host, args.disaggregation_bootstrap_port, entry_ttl_s=2 * self.timeout_s)
            if self.layout.tp_rank == 0 and parts.dp_rank == 0
            else None
        )
        port = self.bootstrap_server.port if self.bootstrap_server else args.disaggregation_bootstrap_port
        mooncake = MooncakeEngine(host) if self.backend == "mooncake" else None
        self.manager = PrefillTcpManager(host, self.layout, self.timeout_s, mooncake)
        local = "127.0.0.1" if args.host in WILDCARD_HOSTS else args.host
        self.manager.register(local, port, self.replicas)
        # With --dp-size > 1 a replica's TP rank 0 tells the bootstrap server about the rooms a
        # decode server cannot place from the room alone (SGLang's /register_dp_rank).
        self.registrar = (
            RoomRegistrar(f"http://{local}:{port}", parts.dp_rank)
            if args.dp_size > 1 and self.layout.tp_rank == 0
            else None
        )
        self.senders: dict[int, KVSender] = {}
        self.owners: dict[int, Req] = {}  # id(req) -> req, for every sender
        self.bootstrap_queue = PrefillBootstrapQueue(self)
        self.inflight_queue: list[Req] = []

    # ------------------------------------------------------------------ arrival
    def admit(self, msg: TokenizedGenerateReqInput, req: Req) -> bool:
        # The prefill side samples one token: admission need not reserve room for a whole output.
        if req.sampling_params.max_new_tokens > 1:
            req.sampling_params = dataclasses.replace(req.sampling_params, max_new_tokens=1)
        return admit_pd(self.parts, msg, req, self.bootstrap_queue.add)

    def create_sender(self, req: Req) -> KVSender:
        room = req.routing.bootstrap_room or 0
        if is_fake(req.routing.bootstrap_host, self.backend):
            return FakeSender(room, self.timeout_s)
        if self.registrar is not None and self._room_needs_registering(req, room):
            self.registrar.add(room)
        return self.manager.create_sender(room)

    def _room_needs_registering(self, req: Req, room: int) -> bool:
        """Whether a decode server could not find this replica without asking: no
        disagg_prefill_dp_rank names it, and the room does not either (follow_bootstrap_room)."""
        if req.routing.disagg_prefill_dp_rank is not None:
            return False
        derived = room % self.replicas.dp_size
        if self.replicas.load_balance_method != "follow_bootstrap_room":
            return True
        if derived != self.replicas.dp_rank:
            # SGLang fails this request ("follow_bootstrap_room conflict"); here it runs, and a
            # decode server told disagg_prefill_dp_rank (the Gateway sends it) finds it.
            logger.warning(
                "Room %d was routed to replica %d (routed_dp_rank), not %d as follow_bootstrap_room "
                "implies: its decode server needs disagg_prefill_dp_rank %d",
                room,
                self.replicas.dp_rank,
                derived,
                self.replicas.dp_rank,
            )
        return False

    # ------------------------------------------------------------------ results
    def on_result(self, batch: ScheduleBatch, result: BatchResult) -> bool:
        """process_batch_result_disagg_prefill: a finished prompt's KV and first token go to its
        decode server; the request moves to the inflight queue (it keeps its KV until acked)."""
        assert isinstance(result, GenerationBatchResult)  # the prefill side only generates
        next_ids, logprobs = OutputProcessor.sampled_tokens(result)
        for i, req in enumerate(batch.reqs):
            req.num_inflight -= 1
            self.parts.output.record_input_logprobs(batch, result, i, req)
            if req.is_chunked > 0:
                req.is_chunked -= 1  # a middle chunk: the builder caches it before the next one
                continue
            if req.to_finish is not None:  # aborted while its prefill ran
                self.abort(req)
                continue
            token = next_ids[i]
            if token is None:  # no valid first token: fail it on both sides, as a colocated server does
                logger.error("Request %s stopped: no valid token (non-finite logits)", req.rid)
                self.senders[id(req)].abort(f"Failed on the prefill server: {INVALID_TOKEN_MESSAGE}")
                self.finish_failed(req, INVALID_TOKEN_MESSAGE, int(HTTPStatus.INTERNAL_SERVER_ERROR))
                continue
            self._send(req, token, logprobs[i] if logprobs is not None else None, result, i)
        return True

    def _send(
        self, req: Req, token: int, logprob: float | None, result: GenerationBatchResult, i: int
    ) -> None:
        req.output_ids.append(token)
        top_val = result.top_logprobs_val[i] if result.top_logprobs_val is not None else None
        top_idx = result.top_logprobs_idx[i] if result.top_logprobs_idx is not None else None
        req.append_output_logprob(token, logprob, top_val, top_idx)
        req.times.first_token = time.monotonic()
        self.parts.mem.tree_cache.cache_unfinished_req(req)  # the prompt becomes shareable now
        self.parts.output.stats.num_generated_tokens += 1  # as a colocated prefill counts it
        sender = self.senders[id(req)]
        meta: dict[str, Any] = {
            "first_token": token,
            "logprob": logprob,
            "top_val": top_val,
            "top_idx": top_idx,
            "cached_tokens": req.cached_tokens,
        }
        num_tokens = len(req.origin_input_ids)
        meta["num_tokens"] = num_tokens
        slots = self.parts.mem.row_slots(req, 0, num_tokens)
        sender.send(meta, lambda heads: wire.gather_kv(self.pool, slots, heads))
        self.inflight_queue.append(req)

    def process_inflight_queue(self) -> None:
        """Release the KV of requests whose transfer ended (the prompt stays in the radix tree)."""
        keep = []
        agreed = agree(self.parts.sync, [self.senders[id(req)] for req in self.inflight_queue])
        for req, status in zip(self.inflight_queue, agreed):
            if req.to_finish is not None and status.status != KVPoll.Success:
                self.abort(req)
            elif status.status == KVPoll.Success:
                req.check_finished()
                if not req.finished():
                    req.finished_reason = FinishLength(len(req.output_ids))
                req.to_finish = None
                self.parts.output.release_if_idle(req)
                self.parts.output.collect(req)
                self._forget(req)
            elif status.status == KVPoll.Failed:
                self.finish_agreed_failure(req, status)
            else:
                keep.append(req)
        self.inflight_queue = keep

    def abort(self, req: Req) -> None:
        """An abort (client, timeout) that arrived while the request was queued here: tell the
        decode side, then finish it (its KV, if any, is released)."""
        message = getattr(req.to_finish, "message", "Aborted.")
        status_code = getattr(req.to_finish, "status_code", None)
        self.senders[id(req)].abort(f"Aborted on the prefill server: {message}")
        req.to_finish = None
        self.finish_failed(req, message, status_code)

    def finish_agreed_failure(self, req: Req, status: Agreed) -> None:
        """A transfer some rank saw fail: the ranks that did not tell their decode peers too."""
        sender = self.senders[id(req)]
        if sender.poll() != KVPoll.Failed:
            sender.abort(status.error or "KV transfer failed on another prefill rank")
        self.finish_failed(req, status.error, status.status_code)

    def finish_failed(self, req: Req, message: str | None, status_code: int | None) -> None:
        logger.info("Request %s (room %s) failed: %s", req.rid, req.routing.bootstrap_room, message)
        self.parts.output.finish_now(req, message or "KV transfer failed", error_status(status_code))
        self._forget(req)

    def sweep_finished(self) -> None:
        """Requests finished outside these queues (an abort or timeout in the waiting queue or
        mid-prompt) still tell their decode side, which would otherwise wait for their KV."""
        for key, req in list(self.owners.items()):
            if req.finished():
                reason = req.finished_reason.to_json() if req.finished_reason else {}
                self.senders[key].abort(f"Aborted on the prefill server: {reason.get('message', 'finished')}")
                self._forget(req)

    def _forget(self, req: Req) -> None:
        self.owners.pop(id(req), None)
        sender = self.senders.pop(id(req), None)
        if sender is not None:
            sender.close()

    # ------------------------------------------------------------------ loop hooks
    def before_schedule(self) -> bool:
        self.bootstrap_queue.pop_bootstrapped()
        return False

    def after_step(self) -> None:
        """event_loop_normal_disagg_prefill: release what was sent, tell the decode side about
        requests finished elsewhere. Nothing ran here joins a running batch (this side never
        decodes), so the step's batch is not kept as last_batch."""
        self.process_inflight_queue()
        self.sweep_finished()
        self.parts.requests.state.last_batch = None

    def has_pending(self) -> bool:
        return bool(self.bootstrap_queue.queue or self.inflight_queue)

    def internal_state(self) -> dict[str, Any]:
        return {
            "disaggregation_mode": "prefill",
            "num_bootstrap_queue_reqs": len(self.bootstrap_queue.queue),
            "num_inflight_queue_reqs": len(self.inflight_queue),
            **self.manager.stats.as_dict(),
        }

    def close(self) -> None:
        self.manager.close()
        if self.registrar is not None:
            self.registrar.close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()
