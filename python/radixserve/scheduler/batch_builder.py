"""Batch construction (seed 001 §4, seed 000 §4): prefill first, else decode the running batch.

get_next_batch_to_run: abort timed-out requests; cache the chunked request's progress; merge the
last prefill batch into the running batch; then try a prefill batch (PrefillAdder over the sorted
waiting queue, priority preemption, optional mixing with the running decodes); else run one decode
step of the running batch, retracting requests when the KV pool cannot hold the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.lora.batch_gate import LoRABatchGate
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.live_limits import LiveLimits
from radixserve.scheduler.output_processor import OutputProcessor
from radixserve.scheduler.policy import SchedulePolicy
from radixserve.scheduler.prefill_adder import AddReqResult, PrefillAdder, remaining_new_tokens
from radixserve.scheduler.req import Req
from radixserve.scheduler.requests import RequestTable, SchedulerState
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.speculative.decode_step import SpeculativeDecodeStep

logger = logging.getLogger(__name__)

DECODE_LOG_INTERVAL = 40  # decode steps between "Decode batch." log lines


@dataclass(frozen=True)
class BatchLimits:
    """The builder's limits fixed at start (the running cap is live: LiveLimits)."""

    max_prefill_tokens: int
    chunked_prefill_size: int | None
    is_mixed_chunk: bool
    prefill_max_requests: int | None
    enable_priority_scheduling: bool
    preemption_threshold: int
    min_new_token_ratio: float
    new_token_ratio_decay: float


class BatchBuilder:
    def __init__(
        self,
        state: SchedulerState,
        requests: RequestTable,
        output: OutputProcessor,
        mem: KVMemory,
        policy: SchedulePolicy,
        limits: BatchLimits,
        live: LiveLimits,
        make_batch: Callable[[list[Req]], ScheduleBatch],
        spec_step: SpeculativeDecodeStep | None = None,  # speculative decoding on
        lora_gate: LoRABatchGate | None = None,  # with --enable-lora
    ) -> None:
        self.state = state
        self.requests = requests
        self.output = output
        self.mem = mem
        self.policy = policy
        self.limits = limits
        self.live = live
        self.make_batch = make_batch
        self.spec_step = spec_step
        self.lora_gate = lora_gate
        self.num_decode_batches = 0

    # ------------------------------------------------------------------ entry point
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        self.requests.abort_on_timeouts()
        st = self.state
        chunked_to_exclude = [st.chunked_req] if st.chunked_req is not None else []
        if st.chunked_req is not None:
            self._cache_chunked_req(st.chunked_req)
        if st.last_batch is not None and st.last_batch.forward_mode.is_prefill():
            self.merge_prefill(st.last_batch, chunked_to_exclude)
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch  # prefill before decode
        if not st.running_batch.is_empty():
            return self.update_running_batch()
        return None

    def merge_prefill(self, batch: ScheduleBatch, chunked_to_exclude: list[Req]) -> None:
        """A prefill batch that ran joins the running batch. Finished requests, the still-chunking
        one and prompt-only requests (max_new_tokens 0: in the overlap loop not yet finished here,
        as their prefill is still in flight) do not."""
        prompt_only = [r for r in batch.reqs if r.sampling_params.max_new_tokens == 0]
        batch.filter_batch(chunked_req_to_exclude=chunked_to_exclude + prompt_only)
        self.state.merge_into_running(batch)

    def _cache_chunked_req(self, req: Req) -> None:
        """Make the chunks computed so far shareable; the request keeps its row for the next chunk
        (freeing the row while a chunk may still be running would let another request reuse it)."""
        self.mem.tree_cache.cache_unfinished_req(req)
        if req.to_finish is not None:  # aborted mid-prompt
            self.state.chunked_req = None
            req.finished_reason, req.to_finish = req.to_finish, None
            self.output.release_if_idle(req)
            self.output.collect(req)

    # ------------------------------------------------------------------ prefill
    def _num_allocatable(self, num_scheduled: int, num_new_rows: int) -> int:
        """How many more requests this round may take. The running cap counts every request
        scheduled this round (the chunked one too: it already holds a row, and joins the running
        batch with its last chunk); the row pool counts only requests that still need a row."""
        by_running = self.live.batch_cap - len(self.state.running_batch.reqs) - num_scheduled
        return min(by_running, self.mem.req_to_token_pool.available_size() - num_new_rows)

    def get_new_batch_prefill(self, beside_running: bool = False) -> ScheduleBatch | None:
        """The next prefill batch, or None. `beside_running`: the running batch is prepared for a
        step that has not run yet (scheduler/idle_capacity.py), so the prefill neither mixes it in
        nor preempts from it."""
        st = self.state
        self.mem.tree_cache.prefetch_step(st.waiting_queue, idle=st.running_batch.is_empty())
        if st.chunked_req is None:
            if not st.waiting_queue:
                return None
            if self._num_allocatable(0, 0) <= 0 and not self.limits.enable_priority_scheduling:
                return None
        prefix_computed = self.policy.calc_priority(st.waiting_queue, st.chunked_req)
        mixed_tokens = mixed_kv = 0
        if self.limits.is_mixed_chunk and not beside_running:
            running = st.running_batch.reqs
            mixed_tokens = len(running)
            mixed_kv = self.mem.decode_tokens_needed([r.kv_committed_len + 1 for r in running])
        adder = PrefillAdder(
            self.mem,
            st.running_batch.reqs + st.other_running_reqs,
            st.new_token_ratio,
            self.limits.max_prefill_tokens,
            self.limits.chunked_prefill_size,
            mixed_tokens,
            mixed_kv,
        )
        if st.chunked_req is not None:
            st.chunked_req.init_next_round_input()
            st.chunked_req = adder.add_chunked_req(st.chunked_req)
        self._admit(adder, prefix_computed, may_preempt=not beside_running)
        for req in adder.preempt_list:
            self.requests.requeue(req)
        if adder.new_chunked_req is not None:
            st.chunked_req = adder.new_chunked_req
        if not adder.can_run_list:
            return None
        if st.chunked_req is not None and any(r is st.chunked_req for r in adder.can_run_list):
            st.chunked_req.is_chunked += 1
        return self._build_prefill(adder, mix=not beside_running)

    def _admit(self, adder: PrefillAdder, prefix_computed: bool, may_preempt: bool) -> None:
        """Offer waiting requests in policy order until a budget runs out."""
        tree = self.mem.tree_cache
        # A hierarchical cache's load-backs evict while requests are admitted: match each again.
        if prefix_computed and not tree.is_hierarchical:
            tree = None
        gate, adapters = self.lora_gate, set()
        if gate is not None:
            st = self.state
            adapters = gate.adapters_of([*st.running_batch.reqs, *st.other_running_reqs, *adder.can_run_list])
        for req in list(self.state.waiting_queue):
            num_new = sum(1 for r in adder.can_run_list if r.req_pool_idx is None)
            cap = self.limits.prefill_max_requests
            if cap is not None and len(adder.can_run_list) >= cap:
                break
            if id(req) in self.policy.deprioritized:
                continue  # in-batch prefix caching: a sibling caches the shared prefix first
            if adder.can_run_list and req.is_embedding != adder.can_run_list[0].is_embedding:
                continue  # a batch either samples or pools: the other kind runs in the next one
            if gate is not None and not gate.admits(req, adapters):
                continue  # its adapter would be one too many: it waits for a later batch
            if not self.mem.tree_cache.prefetch_ready(req):
                continue  # HiCache L3: the prefetch policy holds it until its pages are read
            req.init_next_round_input(tree)
            if self._num_allocatable(len(adder.can_run_list), num_new) <= 0 and not (
                may_preempt and self._preempt_for(req, adder, need_slot=True)
            ):
                break
            result = adder.add_one_req(req)
            added = bool(adder.can_run_list) and adder.can_run_list[-1] is req
            if added and req.lora_id is not None:
                adapters.add(req.lora_id)
            if (
                not added
                and result == AddReqResult.NO_TOKEN
                and may_preempt
                and self._preempt_for(req, adder, need_slot=False)
            ):
                result = adder.add_one_req(req)
            if result != AddReqResult.CONTINUE:
                break

    def _preempt_for(self, req: Req, adder: PrefillAdder, need_slot: bool) -> bool:
        """Priority preemption (seed 000 §15): release running requests whose priority is lower by
        more than the threshold, lowest first, until `req` fits; False (nothing released) if the
        eligible ones cannot make room."""
        if not self.limits.enable_priority_scheduling:
            return False
        running = self.state.running_batch
        preempted = {id(r) for r in adder.preempt_list}
        candidates = sorted(
            (r for r in running.reqs if id(r) not in preempted and not r.finished()),
            key=lambda r: (r.priority, -r.times.received),
        )
        need_tokens = req.extend_input_len + remaining_new_tokens(req) - adder.rem_total_tokens + 1
        chosen: list[Req] = []
        for cand in candidates:
            if req.priority - cand.priority <= self.limits.preemption_threshold:
                break  # sorted by priority: no later candidate qualifies either
            chosen.append(cand)
            need_tokens -= cand.kv_committed_len + adder.reserved_tokens(cand)
            if need_tokens <= 0:
                break
        if not chosen or need_tokens > 0 and not need_slot:
            return False
        chosen_ids = {id(r) for r in chosen}
        keep = []
        for i, r in enumerate(running.reqs):
            if id(r) in chosen_ids:
                running.release_req(i)
                adder.remove_from_budget(r)
            else:
                keep.append(i)
        running.filter_batch(keep_indices=keep)
        adder.preempt_list.extend(chosen)
        logger.info(
            "Preempted %d running request(s) for request %s (priority %d)", len(chosen), req.rid, req.priority
        )
        return True

    def _build_prefill(self, adder: PrefillAdder, mix: bool) -> ScheduleBatch:
        st = self.state
        admitted = {id(r) for r in adder.can_run_list}
        st.waiting_queue[:] = [r for r in st.waiting_queue if id(r) not in admitted]
        batch = self.make_batch(adder.can_run_list)
        batch.prepare_for_extend()
        now = time.monotonic()
        for r in adder.can_run_list:
            if r.times.first_scheduled is None:
                r.times.first_scheduled = now
                r.times.queue_time = now - r.times.queued
        stats = self.output.stats
        stats.cache_hit_tokens += adder.log_hit_tokens
        stats.cache_query_tokens += adder.log_hit_tokens + adder.log_input_tokens
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(adder.can_run_list),
            adder.log_input_tokens,
            adder.log_hit_tokens,
            self.mem.token_usage(),
            len(st.running_batch.reqs),
            len(st.waiting_queue),
        )
        if mix:
            self._maybe_mix(batch)
        return batch

    def _maybe_mix(self, batch: ScheduleBatch) -> None:
        """Mixed chunk (seed 001 §9.3): the running decodes ride along in the prefill forward."""
        st = self.state
        running = st.running_batch
        if not self.limits.is_mixed_chunk or running.is_empty() or batch.is_embedding:
            return
        if batch.return_logprob or running.return_logprob:
            return
        running.filter_batch()
        if running.is_empty() or not running.check_decode_mem():
            return  # no room for the decodes beside the chunk: they run (or retract) next step
        running.prepare_for_decode()
        batch.mix_with_running(running)
        # The mixed batch becomes last_batch and is merged back as the whole running batch.
        st.running_batch = self.make_batch([])

    # ------------------------------------------------------------------ decode
    def update_running_batch(self) -> ScheduleBatch | None:
        st = self.state
        batch = st.running_batch
        batch.filter_batch()
        if batch.is_empty():
            return None
        if not batch.check_decode_mem():
            old_ratio = st.new_token_ratio
            retracted, ratio, to_abort = batch.retract_decode(self.limits.enable_priority_scheduling)
            st.new_token_ratio = max(st.new_token_ratio, ratio)
            self.output.stats.num_retracted_reqs += len(retracted)
            for req in retracted:
                self.requests.requeue(req)
            for req in to_abort:
                self.output.finish_now(req, "The request does not fit in the KV cache even alone.", 503)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
                len(retracted),
                old_ratio,
                st.new_token_ratio,
            )
            if batch.is_empty():
                return None
        else:
            st.new_token_ratio = max(
                st.new_token_ratio - self.limits.new_token_ratio_decay, self.limits.min_new_token_ratio
            )
        if self.spec_step is not None:
            # A verify step when drafts exist and fit; the decode step's KV fits either way.
            self.spec_step.prepare(batch, self.mem.req_to_token_pool.req_to_token.shape[1])
        else:
            batch.prepare_for_decode()
        self.num_decode_batches += 1
        if self.num_decode_batches % DECODE_LOG_INTERVAL == 0:
            self._log_decode(batch)
        return batch

    def _log_decode(self, batch: ScheduleBatch) -> None:
        stats = self.output.stats
        now = time.monotonic()
        stats.last_gen_throughput = stats.num_generated_tokens / max(now - stats.last_log_time, 1e-6)
        stats.num_generated_tokens, stats.last_log_time = 0, now
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d",
            len(batch.reqs),
            self.mem.num_used_tokens(),
            self.mem.token_usage(),
            stats.last_gen_throughput,
            len(self.state.waiting_queue),
        )
