"""The decode side of a disaggregated pair (seed INVENTORY §33).

A request bootstraps with its prefill server in the DecodePreallocQueue, gets a request row and
KV pages there when the pool has room (back-pressure: it waits otherwise), then waits in the
DecodeTransferQueue until its KV and first token arrived. Those requests join the running batch
as a PREBUILT batch: no forward, the prompt is never recomputed. Decoding is the usual loop; the
queues are its hooks (scheduler/loops.py: LoopHooks).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from radixserve.disaggregation import wire
from radixserve.disaggregation.backend import FakeReceiver, KVReceiver
from radixserve.disaggregation.common import (
    Agreed,
    SideParts,
    admit_pd,
    advertised_host,
    agree,
    mark_scheduled,
)
from radixserve.disaggregation.mooncake_engine import MooncakeEngine
from radixserve.disaggregation.tcp_decode import DecodeTcpManager
from radixserve.disaggregation.utils import KVPoll, error_status, is_fake
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.model_executor.forward_batch import ForwardMode
from radixserve.scheduler.loops import LoopHooks
from radixserve.scheduler.prefill_adder import remaining_new_tokens
from radixserve.scheduler.req import Req

logger = logging.getLogger(__name__)


class DecodePreallocQueue:
    """Requests bootstrapping with their prefill server; they get KV pages here, in order."""

    def __init__(self, side: DecodeDisaggregation) -> None:
        self.side = side
        self.queue: list[Req] = []

    def add(self, req: Req) -> None:
        self.side.receivers[id(req)] = self.side.create_receiver(req)
        req.times.queued = time.monotonic()
        self.queue.append(req)

    def pop_preallocated(self) -> list[Req]:
        side, keep, out = self.side, [], []
        blocked = False
        agreed = agree(side.parts.sync, [side.receivers[id(req)] for req in self.queue])
        for req, status in zip(self.queue, agreed):
            if req.to_finish is not None:
                side.abort(req)
            elif status.status == KVPoll.Failed:
                side.finish_failed(req, status)
            elif status.status == KVPoll.WaitingForInput and not blocked and side.fits(req):
                side.preallocate(req)
                side.receivers[id(req)].init(len(req.origin_input_ids))
                out.append(req)
            else:
                # Back-pressure keeps arrival order: once one request does not fit, later ones wait.
                blocked = blocked or status.status == KVPoll.WaitingForInput
                keep.append(req)
        self.queue = keep
        return out


class DecodeTransferQueue:
    """Requests whose pages are allocated and whose KV is on its way."""

    def __init__(self, side: DecodeDisaggregation) -> None:
        self.side = side
        self.queue: list[Req] = []

    def pop_transferred(self) -> list[Req]:
        side, keep, ready = self.side, [], []
        agreed = agree(side.parts.sync, [side.receivers[id(req)] for req in self.queue])
        for req, status in zip(self.queue, agreed):
            if req.to_finish is not None and status.status != KVPoll.Success:
                side.abort(req)
            elif status.status == KVPoll.Failed:
                side.finish_failed(req, status)
            elif status.status == KVPoll.Success:  # every rank's KV heads arrived
                side.commit(req, *side.receivers[id(req)].result())
                ready.append(req)
            else:
                keep.append(req)
        self.queue = keep
        return ready


class DecodeDisaggregation(LoopHooks):
    def __init__(self, parts: SideParts) -> None:
        args = parts.args
        self.parts = parts
        self.backend = args.disaggregation_transfer_backend
        self.timeout_s = args.disaggregation_bootstrap_timeout
        self.pool = parts.kv_pool
        self.layout = parts.layout
        mooncake = MooncakeEngine(advertised_host(args.host)) if self.backend == "mooncake" else None
        self.manager = DecodeTcpManager(self.layout, self.timeout_s, mooncake)
        self.receivers: dict[int, KVReceiver] = {}
        self.prealloc_queue = DecodePreallocQueue(self)
        self.transfer_queue = DecodeTransferQueue(self)

    # ------------------------------------------------------------------ arrival
    def admit(self, msg: TokenizedGenerateReqInput, req: Req) -> bool:
        return admit_pd(self.parts, msg, req, self.prealloc_queue.add)

    def create_receiver(self, req: Req) -> KVReceiver:
        routing = req.routing
        room = routing.bootstrap_room or 0
        if is_fake(routing.bootstrap_host, self.backend):
            return FakeReceiver(room, self.timeout_s)
        assert routing.bootstrap_host is not None and routing.bootstrap_port is not None
        return self.manager.create_receiver(
            room, routing.bootstrap_host, routing.bootstrap_port, routing.disagg_prefill_dp_rank
        )

    # ------------------------------------------------------------------ memory
    def fits(self, req: Req) -> bool:
        """Whether a row and the prompt's pages are free, keeping room for the running requests'
        future tokens (scaled by new_token_ratio, as admission does) and the running cap. Requests
        admitted earlier in the same pass are already in the transfer queue, so they count once."""
        mem, st = self.parts.mem, self.parts.requests.state
        active = st.running_batch.reqs + self.transfer_queue.queue
        if len(active) + 1 > self.parts.limits.max_running_requests:
            return False
        if mem.req_to_token_pool.available_size() < 1:
            return False
        reserved = sum(remaining_new_tokens(r) for r in active) * st.new_token_ratio
        need = mem.ceil_paged(len(req.origin_input_ids)) + mem.page_size
        return mem.available_size() + mem.evictable_size() - reserved >= need

    def preallocate(self, req: Req) -> None:
        mem = self.parts.mem
        num_tokens = len(req.origin_input_ids)
        req.req_pool_idx = mem.alloc_rows(1)[0]
        slots = mem.alloc_extend([0], [num_tokens], [-1], num_tokens)
        table = mem.req_to_token_pool.req_to_token
        table[req.req_pool_idx, :num_tokens] = slots.to(table.device, table.dtype)
        req.fill_ids = list(req.origin_input_ids)
        req.kv_committed_len = num_tokens  # the transfer writes every prompt position
        req.last_node = None
        self.transfer_queue.queue.append(req)

    def commit(self, req: Req, meta: dict[str, Any], pieces: list[tuple[dict[str, Any], memoryview]]) -> None:
        """The KV arrived: write each prefill rank's heads into the request's pages (at this
        rank's local head index) and take the first token."""
        num_tokens = len(req.origin_input_ids)
        slots = self.parts.mem.row_slots(req, 0, num_tokens)
        for msg, data in pieces:
            start = msg["heads"][0] - self.layout.heads[0] if msg.get("heads") else 0
            wire.scatter_kv(self.pool, slots, data, msg["shape"], msg["dtype"], start)
        # The fake backend sends no token: the probe's output is meaningless, as in SGLang.
        token = meta["first_token"] if meta.get("first_token") is not None else req.origin_input_ids[-1]
        if req.sampling_params.max_new_tokens > 0:
            req.output_ids.append(token)
            # This server emits it: counted as a colocated server counts its first token.
            self.parts.output.stats.num_generated_tokens += 1
            req.append_output_logprob(token, meta.get("logprob"), meta.get("top_val"), meta.get("top_idx"))
        req.cached_tokens = int(meta.get("cached_tokens") or 0)
        mark_scheduled(req)
        req.times.first_token = time.monotonic()
        self._forget(req)

    # ------------------------------------------------------------------ PREBUILT
    def process_prebuilt(self, reqs: list[Req]) -> None:
        """process_batch_result_prebuilt: report the first tokens, finish what is done, and merge
        the rest into the running batch (their next step is an ordinary decode)."""
        output = self.parts.output
        batch = self.parts.make_batch(reqs)
        batch.forward_mode = ForwardMode.PREBUILT
        # Penalty counts need no update here: they are synced from output_ids before each sample.
        for req in reqs:
            req.check_finished()
            if req.finished():
                output.release_if_idle(req)
            output.collect(req)
        batch.filter_batch()
        self.parts.requests.state.merge_into_running(batch)

    # ------------------------------------------------------------------ failures
    def abort(self, req: Req) -> None:
        message = getattr(req.to_finish, "message", "Aborted.")
        status_code = getattr(req.to_finish, "status_code", None)
        req.to_finish = None
        self.receivers[id(req)].abort(f"Aborted on the decode server: {message}")
        self._finish(req, message, status_code)

    def finish_failed(self, req: Req, status: Agreed) -> None:
        """A transfer some rank saw fail: the ranks that did not tell their prefill peers too."""
        receiver = self.receivers[id(req)]
        if receiver.poll() != KVPoll.Failed:
            receiver.abort(status.error or "KV transfer failed on another decode rank")
        self._finish(req, status.error or "KV transfer failed", error_status(status.status_code))

    def _finish(self, req: Req, message: str, status_code: int | None) -> None:
        logger.info("Request %s (room %s) failed: %s", req.rid, req.routing.bootstrap_room, message)
        if req.holds_kv():  # pages allocated, KV never (completely) arrived: free, cache nothing
            self.parts.mem.release_retracted(req)
        self.parts.output.finish_now(req, message, status_code)
        self._forget(req)

    def _forget(self, req: Req) -> None:
        receiver = self.receivers.pop(id(req), None)
        if receiver is not None:
            receiver.close()

    # ------------------------------------------------------------------ loop hooks
    def before_schedule(self) -> bool:
        """event_loop_normal_disagg_decode: preallocate, then collect the transferred KV into a
        PREBUILT batch; the usual step follows (decode the running batch; re-prefill locally only
        what was retracted)."""
        self.prealloc_queue.pop_preallocated()
        ready = self.transfer_queue.pop_transferred()
        if ready:
            self.process_prebuilt(ready)
        return bool(ready)

    def has_pending(self) -> bool:
        return bool(self.prealloc_queue.queue or self.transfer_queue.queue)

    def internal_state(self) -> dict[str, Any]:
        return {
            "disaggregation_mode": "decode",
            "num_prealloc_queue_reqs": len(self.prealloc_queue.queue),
            "num_transfer_queue_reqs": len(self.transfer_queue.queue),
            "kv_transfer_bytes_received": self.manager.bytes_received,
        }

    def close(self) -> None:
        self.manager.close()
