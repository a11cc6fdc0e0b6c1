"""The scheduler's answer to GetDashboardStateReq (/dashboard/state, docs/observability.md).

Built only when asked: the dashboard polls about once a second while a page is open, and nothing
here runs otherwise. The cost is bounded: the live-request table lists at most `max_rows` rows
(the oldest first) and the recent batches come from the BatchLog's fixed ring.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any

from radixserve.distributed.rank_runtime import RankSync
from radixserve.managers.io_struct import GetDashboardStateReq, GetDashboardStateReqOutput
from radixserve.scheduler.batch_log import BatchLog
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.output_processor import StepStats
from radixserve.scheduler.req import Req
from radixserve.scheduler.requests import SchedulerState

MAX_ROWS_LIMIT = 200  # a caller asking for more rows gets this many


class DashboardReport:
    def __init__(
        self,
        state: SchedulerState,
        mem: KVMemory,
        stats: StepStats,
        batch_log: BatchLog,
        sync: RankSync,
        grammar_queue_size: Callable[[], int],  # requests waiting for their grammar
        dp_rank: int,
        ranks: tuple[int, int],  # this rank's (tp_rank, pp_rank)
    ) -> None:
        self.state = state
        self.mem = mem
        self.stats = stats
        self.batch_log = batch_log
        self.sync = sync
        self.grammar_queue_size = grammar_queue_size
        self.dp_rank = dp_rank
        self.ranks = ranks

    def report(self, msg: GetDashboardStateReq) -> GetDashboardStateReqOutput:
        # Every rank gets the request in the same step (like GetInternalStateReq): the gather is
        # an agreement, and only the first rank's answer leaves the process.
        per_rank = self.sync.gather(self._rank_report())
        state, mem, stats = self.state, self.mem, self.stats
        running = len(state.running_batch.reqs) + len(state.other_running_reqs)
        return GetDashboardStateReqOutput(
            {
                "dp_rank": self.dp_rank,
                "time": time.time(),
                "num_running_reqs": running,
                "num_waiting_reqs": len(state.waiting_queue),
                "num_grammar_queue_reqs": self.grammar_queue_size(),
                "max_total_num_tokens": mem.total_tokens,
                "used_tokens": mem.num_used_tokens(),
                "available_tokens": mem.available_size(),
                "evictable_tokens": mem.evictable_size(),
                "cached_tokens": mem.tree_cache.total_size(),
                "cache_hit_tokens": stats.cache_hit_tokens,
                "cache_query_tokens": stats.cache_query_tokens,
                **self.batch_log.counters(),
                "batches": [r.as_dict() for r in reversed(self.batch_log.recent)],  # newest first
                "num_live_reqs": len(state.live),
                "requests": self._request_rows(min(max(msg.max_rows, 0), MAX_ROWS_LIMIT)),
                "ranks": per_rank,
            }
        )

    def _rank_report(self) -> dict[str, Any]:
        mean_ms = self.batch_log.mean_ms()
        return {
            "tp_rank": self.ranks[0],
            "pp_rank": self.ranks[1],
            "max_total_num_tokens": self.mem.total_tokens,
            "used_tokens": self.mem.num_used_tokens(),
            "evictable_tokens": self.mem.evictable_size(),
            "mean_batch_ms": None if mean_ms is None else round(mean_ms, 3),
        }

    def _request_rows(self, max_rows: int) -> list[dict[str, Any]]:
        """The oldest `max_rows` live requests (rid, age, tokens, state)."""
        state = self.state
        oldest = heapq.nsmallest(max_rows, state.live.values(), key=lambda r: r.times.received)
        waiting = {id(r) for r in state.waiting_queue}
        running = {id(r) for r in state.running_batch.reqs} | {id(r) for r in state.other_running_reqs}
        now = time.time()
        return [
            {
                "rid": req.rid,
                "age_s": round(max(now - req.times.received, 0.0), 3),
                "prompt_tokens": len(req.origin_input_ids),
                "output_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens,
                "state": _req_state(req, id(req) in waiting, id(req) in running, req is state.chunked_req),
            }
            for req in oldest
        ]


def _req_state(req: Req, waiting: bool, running: bool, chunked: bool) -> str:
    if req.finished():
        return "finishing"  # finished in the last step; its output is on its way
    if waiting:
        return "retracted" if req.is_retracted else "waiting"
    if chunked:
        return "prefilling"
    if running:
        return "decoding" if req.output_ids else "prefilling"
    # Neither queued nor running: a grammar still compiling, or a PD side's own queues.
    return "pending"
