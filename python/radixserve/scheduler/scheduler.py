"""The Scheduler: the core the loop steps (seed 001 §2); it owns the small objects that do the work.

    scheduler = Scheduler(server_args, worker, tokenizer=None, eos_token_ids=(2,), send_output=out.append)
    loop = build_loop(scheduler)           # scheduler/build.py: executor and hooks for the flags
    scheduler.process_input_requests([TokenizedGenerateReqInput(...)])
    while not scheduler.is_idle(): loop.step()
    loop.run_forever(recv_requests)        # the process's `while True` around the same step()

Collaborators: KVMemory (pools + prefix cache), RequestTable (queue, live requests, abort,
timeouts), SchedulePolicy, BatchBuilder (next batch), OutputProcessor (results and streaming).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from http import HTTPStatus
from typing import Any

import torch

from radixserve.configs.hicache_args import HiCacheConfig
from radixserve.constrained.grammar_backend import GrammarBackend
from radixserve.constrained.grammar_manager import NO_TOKENIZER, TURNED_OFF, GrammarManager
from radixserve.distributed.rank_runtime import LocalSync, RankSync
from radixserve.lora.batch_gate import LoRABatchGate
from radixserve.managers.io_struct import (
    AbortReq,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    ControlOutcome,
    EmbeddingBatchResult,
    FlushCacheReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TypeBasedDispatcher,
)
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.hicache_build import build_hicache
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch
from radixserve.model_executor.worker_api import ModelWorker
from radixserve.sampling.custom_logit_processor import processor_for
from radixserve.scheduler.activity import Activity
from radixserve.scheduler.batch_builder import BatchBuilder, BatchLimits
from radixserve.scheduler.batch_log import BatchLog
from radixserve.scheduler.control_plane import ControlPlane
from radixserve.scheduler.control_table import control_handlers, internal_state
from radixserve.scheduler.dashboard_report import DashboardReport
from radixserve.scheduler.health_probes import HealthProbes
from radixserve.scheduler.input_blocker import SchedulerInputBlocker
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.live_limits import LiveLimits
from radixserve.scheduler.loops import LoopHooks
from radixserve.scheduler.lora_control import LoRAControl
from radixserve.scheduler.operator_controls import OperatorControls
from radixserve.scheduler.output_processor import OutputProcessor
from radixserve.scheduler.pause import PauseControl
from radixserve.scheduler.policy import SchedulePolicy
from radixserve.scheduler.req import Req
from radixserve.scheduler.requests import RequestTable, SchedulerState
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.scheduler.sessions import SessionController
from radixserve.scheduler.weight_control import MemoryOccupation, WeightControl
from radixserve.server_args import ServerArgs
from radixserve.speculative.decode_step import SpeculativeDecodeStep
from radixserve.utils.process import release_free_memory

logger = logging.getLogger(__name__)

# While only grammar compilations are pending, the loop sleeps on them at most this long per step.
GRAMMAR_WAIT_S = 0.01

# new_token_ratio schedule (seed 000 §10.3, §19): start, floor, and per-decode-step decay.
INIT_NEW_TOKEN_RATIO = 0.4
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        worker: ModelWorker,
        tokenizer: Any = None,  # noqa: ANN401 - any HF-style tokenizer; None disables stop strings
        eos_token_ids: Sequence[int] = (),
        send_output: Callable[[object], None] = lambda msg: None,
        grammar_backend: GrammarBackend | None = None,  # default: xgrammar on `tokenizer`, on first use
        sync: RankSync | None = None,  # agreements with the other ranks (multi-rank layouts)
        dp_rank: int = 0,  # the data-parallel replica this scheduler belongs to (--dp-size)
    ) -> None:
        self.server_args = server_args
        self.dp_rank = dp_rank
        self.worker = worker
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.send_output = send_output
        self.device = worker.info.device
        self.sync: RankSync = sync or LocalSync()
        self._build_core(sync, grammar_backend)
        self._build_addons()
        self.dispatcher = self._build_dispatcher()
        self.num_inflight_batches = 0  # launched, results not processed yet
        self.num_steps = 0  # steps so far: the watchdog's progress counter
        self.busy_since_trim = False  # a batch ran since the heap was last trimmed
        # The loop's hooks (scheduler/build.py sets them): a PD side admits requests into its
        # own queues and reports them in the internal state.
        self.hooks = LoopHooks()

    @property
    def max_running_requests(self) -> int:
        return self.live_limits.max_running_requests

    def _build_memory(self) -> KVMemory:
        worker, args = self.worker, self.server_args
        allocator, rows = worker.pools.token_to_kv_pool_allocator, worker.pools.req_to_token_pool
        # Encoders attend bidirectionally: a token's KV depends on the tokens after it, so no
        # prefix can be shared and the radix cache would only hold KV nobody may reuse.
        if args.disable_radix_cache or not worker.info.is_causal:
            cache: ChunkCache | RadixCache = ChunkCache(rows, allocator, allocator.page_size)
        elif args.enable_hierarchical_cache:
            cache = build_hicache(
                rows,
                allocator,
                worker.pools.token_to_kv_pool,
                HiCacheConfig.from_server_args(args),
                worker.info.tp_rank,
                self.sync,
            )
        else:
            cache = RadixCache(rows, allocator, allocator.page_size, args.radix_eviction_policy)
        return KVMemory(rows, allocator, cache, allocator.page_size)

    def _build_core(self, sync: RankSync | None, grammar_backend: GrammarBackend | None) -> None:
        """Memory, state, requests, grammar, policy, builder, output: what every layout runs."""
        args, worker = self.server_args, self.worker
        self.is_generation = worker.info.is_generation
        self.embedding_needs_all_tokens = worker.info.embedding_needs_all_tokens
        self.mem = self._build_memory()
        self.chunked_prefill_size = (
            args.chunked_prefill_size if (args.chunked_prefill_size or 0) > 0 else None
        )
        self.live_limits = LiveLimits.from_server_args(args, worker.pools.max_req_num, worker.info.pp_size)
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0)
        self.state = SchedulerState(self.make_batch([]), self.init_new_token_ratio)
        self.batch_log = BatchLog(trace=args.enable_trace)  # recent batches (dashboard), traced requests
        self.output = OutputProcessor(
            self.mem,
            self.send_output,
            on_finished=self._on_finished,
            report_spec=args.speculative_algorithm is not None,
            report_traces=args.enable_trace,
        )
        max_req_len = min(worker.pools.max_context_len, worker.pools.max_total_num_tokens)
        loras = worker.info.lora.adapters if worker.info.lora is not None else ()  # the live dict
        self.requests = RequestTable(
            self.state, self.output, self.live_limits, max_req_len, sync, loras, worker.info.takes_images
        )
        self.health_probes = HealthProbes(self.state.live, self.output.collect)
        self.grammar = GrammarManager(
            self._grammar_backend_factory(grammar_backend),
            args.grammar_compile_timeout,
            self.requests.enqueue,
            self.output.finish_now,
            sync,
            unavailable_reason=TURNED_OFF if args.grammar_backend == "none" else NO_TOKENIZER,
        )
        self.policy = SchedulePolicy(
            args.schedule_policy, self.mem.tree_cache, args.enable_priority_scheduling, args.random_seed
        )
        self.builder = BatchBuilder(
            self.state,
            self.requests,
            self.output,
            self.mem,
            self.policy,
            self._batch_limits(),
            self.live_limits,
            self.make_batch,
            SpeculativeDecodeStep.from_server_args(args, self.mem, sync),
            LoRABatchGate(args.max_loras_per_batch) if args.enable_lora else None,
        )

    def _build_addons(self) -> None:
        """The control add-ons, each given the few objects it uses, and sessions."""
        activity = Activity(self.state, lambda: self.num_inflight_batches)
        tp_rank, weights = self.worker.info.tp_rank, self.worker.info.weights
        self.pause = PauseControl(self.requests, activity)
        self.control = ControlPlane(
            SchedulerInputBlocker(sync=self.sync), self.requests, activity, self.pause
        )
        self.weight_control = WeightControl(
            weights, tp_rank, self.sync, activity, self.mem, self.flush_cache, self.server_args.weight_version
        )
        self.memory_occupation = MemoryOccupation(weights, self.sync, activity, self.mem, self.weight_control)
        self.operators = OperatorControls(self.live_limits, tp_rank)
        self.lora_control = LoRAControl(self.worker.info.lora, self.state.live)
        self.dashboard = DashboardReport(
            self.state,
            self.mem,
            self.output.stats,
            self.batch_log,
            self.sync,
            lambda: len(self.grammar.grammar_queue),
            self.dp_rank,
            (tp_rank, self.worker.info.pp_rank),
        )
        self.sessions = SessionController(
            self._build_session_req,
            lambda req: self.requests.abort_req(req, "Replaced by a new branch of its session."),
            getattr(self.tokenizer, "bos_token_id", None),
        )

    def _build_dispatcher(self) -> TypeBasedDispatcher:
        return TypeBasedDispatcher(
            [
                (TokenizedGenerateReqInput, self.handle_generate_request),
                (BatchTokenizedGenerateReqInput, self.handle_batch_generate_request),
                (TokenizedEmbeddingReqInput, self.handle_embedding_request),
                (BatchTokenizedEmbeddingReqInput, self.handle_batch_embedding_request),
                (AbortReq, self.requests.abort),
                (FlushCacheReqInput, self.flush_cache),
                (GetInternalStateReq, self.get_internal_state),
                *control_handlers(self),
                (GetLoadReqInput, self.get_load),
            ]
        )

    def _batch_limits(self) -> BatchLimits:
        args = self.server_args
        return BatchLimits(
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=self.chunked_prefill_size,
            is_mixed_chunk=self.chunked_prefill_size is not None and args.enable_mixed_chunk,
            prefill_max_requests=args.prefill_max_requests,
            enable_priority_scheduling=args.enable_priority_scheduling,
            preemption_threshold=args.priority_scheduling_preemption_threshold,
            min_new_token_ratio=min(MIN_NEW_TOKEN_RATIO, self.init_new_token_ratio),
            new_token_ratio_decay=NEW_TOKEN_RATIO_DECAY,
        )

    def _grammar_backend_factory(self, backend: GrammarBackend | None) -> Callable[[], GrammarBackend] | None:
        if backend is not None:
            return lambda: backend
        if self.tokenizer is None or self.server_args.grammar_backend == "none":
            return None
        return lambda: GrammarBackend(self.tokenizer, self.worker.info.vocab_size, self.eos_token_ids)

    def make_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch.init_new(
            reqs, self.mem, self.worker.info.vocab_size, self.device, self.eos_token_ids
        )

    # ------------------------------------------------------------------ input
    def process_input_requests(self, recv_reqs: Iterable[object]) -> None:
        # The control plane holds what must wait (BLOCK, a weight update waiting for in-flight
        # forwards, a pause) and dispatches the rest.
        self.num_steps += 1
        self.operators.profiler.on_step()
        self.control.process(recv_reqs, self._dispatch)

    def _dispatch(self, msg: object) -> None:
        reply = self.dispatcher(msg)
        if isinstance(reply, ControlOutcome):  # ControlClient finds its waiter by the request
            reply = replace(reply, answers=type(msg).__name__)
        if reply is not None:
            self.send_output(reply)

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        error = None
        if msg.session_params is not None and msg.session_params.id is not None:
            req, error = self.sessions.create_req(msg)
        else:
            req = Req(msg, self.eos_token_ids, self.tokenizer)
        if error is None and msg.custom_logit_processor is not None:
            req.custom_logit_processor, error = processor_for(msg.custom_logit_processor, self.server_args)
        released = self.memory_occupation.released_message()
        if error is not None or released is not None:
            self.state.live[req.rid] = req
            status = HTTPStatus.BAD_REQUEST if error is not None else HTTPStatus.SERVICE_UNAVAILABLE
            self.output.finish_now(req, error or released or "", int(status))
            return
        if not self.is_generation:  # input_validation refuses these first; a direct caller must not crash it
            self.state.live[req.rid] = req
            self.output.finish_now(req, "This model is an embedding model and cannot generate.", 400)
            return
        if msg.health_check and self._has_work():
            self.health_probes.defer(req)  # answered by the next batch result, never queued
            return
        if not self.hooks.admit(
            msg, req
        ):  # PD: bootstrap first (PrefillBootstrapQueue / DecodePreallocQueue)
            self.requests.add(req, self.grammar.route)  # constrained requests wait for their grammar

    def _build_session_req(self, msg: TokenizedGenerateReqInput, input_ids: list[int]) -> Req:
        return Req(replace(msg, input_ids=input_ids), self.eos_token_ids, self.tokenizer)

    def _on_finished(self, req: Req) -> None:
        self.requests.forget(req)
        if req.session_id is not None:
            self.sessions.on_finished(req)

    def handle_batch_generate_request(self, msg: BatchTokenizedGenerateReqInput) -> None:
        for req in msg.reqs:
            self.handle_generate_request(req)

    def handle_embedding_request(self, msg: TokenizedEmbeddingReqInput) -> None:
        """A prefill-only request (seed 000 §17): queued like any other, finished at its prefill."""
        req = RequestTable.build_embedding_req(msg, self.embedding_needs_all_tokens)
        if self.server_args.pp_size > 1:  # the pipeline loop only samples
            self.requests.state.live[req.rid] = req
            self.output.finish_now(req, "Prefill-only requests do not run with --pp-size > 1.", 400)
            return
        self.requests.add(req)

    def handle_batch_embedding_request(self, msg: BatchTokenizedEmbeddingReqInput) -> None:
        logger.debug("Processing batch embedding request with %d requests", len(msg.reqs))
        for req in msg.reqs:
            self.handle_embedding_request(req)

    # ------------------------------------------------------------------ control requests
    def is_idle(self) -> bool:
        return (
            self.state.is_idle()
            and not self.state.waiting_queue
            and self.num_inflight_batches == 0
            and not self.control.has_waiting_work()
        )

    def should_block_on_recv(self) -> bool:
        """Whether the loop may wait for input: nothing to do until a request arrives (idle, or
        paused with nothing in flight)."""
        if self.is_idle():
            return True
        return self.pause.stops_scheduling() and self.num_inflight_batches == 0

    def flush_cache(self, msg: FlushCacheReqInput | None = None) -> ControlOutcome:
        if self.num_inflight_batches == 0:
            # A request that finished in the last step leaves the running batch only in the next
            # one, but holds no KV: a flush sent as soon as the last answer arrived must not fail.
            self.state.running_batch.filter_batch()
        if not self.is_idle():
            message = (
                f"Cannot flush the cache while requests are in flight (#queue-req: "
                f"{len(self.state.waiting_queue)}, #running-req: {len(self.state.running_batch.reqs)})."
            )
            logger.warning(message)
            return ControlOutcome(False, message)
        self.mem.flush()
        self.state.new_token_ratio = self.init_new_token_ratio
        self.output.stats.cache_hit_tokens = self.output.stats.cache_query_tokens = 0
        release_free_memory()
        logger.info("Cache flushed successfully.")
        return ControlOutcome(True, "Cache flushed.")

    def get_load(self, msg: GetLoadReqInput | None = None) -> GetLoadReqOutput:
        """SGLang's load: requests alive, and tokens (KV held by requests + waiting prompts).
        Requests that finished in the last step leave the running batch only in the next one: they
        are not load (reported as such, the controller would send new work elsewhere)."""
        waiting = self.state.waiting_queue
        alive = [*self.state.running_batch.reqs, *self.state.other_running_reqs]
        running = sum(1 for r in alive if not r.finished())
        return GetLoadReqOutput(
            dp_rank=self.dp_rank,
            num_reqs=running + len(waiting),
            num_waiting_reqs=len(waiting),
            num_tokens=self.mem.num_used_tokens() + sum(len(r.origin_input_ids) for r in waiting),
        )

    def get_internal_state(self, msg: GetInternalStateReq | None = None) -> GetInternalStateReqOutput:
        return GetInternalStateReqOutput(internal_state=internal_state(self))

    def check_memory_leak(self) -> str | None:
        """None when the pools are consistent; a description of the leak otherwise (idle only)."""
        if not self.is_idle():
            return "the scheduler is not idle: memory can only be checked with no request alive"
        return self.mem.check_leak()

    def self_check_during_idle(self) -> None:
        """When idle, verify no KV slot or row leaked, re-init the admission ratio and, once per
        idle period, return the heap memory the busy period freed to the OS."""
        if not self.is_idle():
            return
        problem = self.mem.check_leak()
        if problem is not None:
            logger.error("KV MEMORY LEAK DETECTED while idle: %s", problem)
        self.state.new_token_ratio = self.init_new_token_ratio
        if self.busy_since_trim:
            self.busy_since_trim = False
            release_free_memory()

    # ------------------------------------------------------------------ running batches
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.pause.stops_scheduling():
            self.pause.settle_while_stopped()
            return None
        self.grammar.move_ready()
        batch = self.builder.get_next_batch_to_run()
        self.requests.enforce_queue_cap(self.grammar.queued_reqs())
        if batch is None and self.num_inflight_batches == 0 and self.grammar.has_pending():
            self.grammar.wait_for_any(GRAMMAR_WAIT_S)
        return batch

    def prepare_sample(self, reqs: list[Req], mwb: ModelWorkerBatch) -> None:
        """The sampling state that depends on earlier tokens: the grammar mask of this step and
        the penalty / min_new_tokens counts. Every earlier result of `reqs` must be processed (their
        matchers and output_ids hold every earlier token)."""
        info = mwb.sampling_info
        if info is None:
            return
        # Set on the forward's shallow copy only: the live batch never carries a stale mask.
        info.vocab_mask = self.grammar.vocab_mask(reqs, self.worker.info.vocab_size)
        info.sync_output_tokens([r.output_ids for r in reqs])

    def launch(
        self, batch: ScheduleBatch, future_indices: list[int] | None = None, delay_sample: bool = False
    ) -> ModelWorkerBatch:
        """The launch sequence every executor runs (scheduler/loops.py): the forward's view of
        `batch`, the batch and its requests marked in flight, the operator controls told a forward
        starts; the caller then starts the forward. The sampling state is prepared now, or, with
        `delay_sample`, left to prepare_sample right before the delayed sample is launched."""
        mwb = batch.get_model_worker_batch()
        mwb.delay_sample_launch = delay_sample
        if not delay_sample:
            self.prepare_sample(batch.reqs, mwb)
        batch.future_indices = future_indices
        self.num_inflight_batches += 1
        self.batch_log.on_launch(batch)
        for i, req in enumerate(batch.reqs):
            req.num_inflight += 1
            if future_indices is not None:
                req.pending_future = future_indices[i]
        self.operators.before_forward()
        return mwb

    def run_batch(
        self, batch: ScheduleBatch, should_yield: Callable[[], bool] | None = None
    ) -> GenerationBatchResult | EmbeddingBatchResult:
        """Launch and wait for the forward (sync and pipeline executors); a prefill-only batch
        samples nothing. `should_yield`: ModelWorkerBatch.should_yield (may raise StepYielded)."""
        mwb = self.launch(batch)
        mwb.should_yield = should_yield
        with torch.inference_mode():
            if mwb.is_embedding:
                return self.worker.forward_batch_embedding(mwb)
            start = time.perf_counter()  # the batch-level back-off rule weighs step times
            result = self.worker.forward_batch_generation(mwb)
        spec = self.builder.spec_step
        if spec is not None and (mwb.forward_mode.is_decode() or mwb.forward_mode.is_target_verify()):
            elapsed = time.perf_counter() - start
            spec.observe_step(
                mwb.forward_mode.is_target_verify(), mwb.batch_size, int(mwb.input_ids.shape[0]), elapsed
            )
        return result

    def process_batch_result(
        self, batch: ScheduleBatch, result: GenerationBatchResult | EmbeddingBatchResult
    ) -> None:
        self.note_batch_done()
        self.output.process_batch_result(batch, result)

    def note_batch_done(self) -> None:
        """Bookkeeping of every batch whose result comes back, whoever processes it (the output
        processor, or a disaggregated prefill side)."""
        self.num_inflight_batches -= 1
        self.batch_log.on_done()
        self.health_probes.answer()
        self.busy_since_trim = True  # heap trimmed at the next idle step

    def _has_work(self) -> bool:
        st = self.state
        return (
            bool(st.running_batch.reqs or st.waiting_queue or st.chunked_req) or self.num_inflight_batches > 0
        )

    def is_disable_overlap_for_batch(self, batch: ScheduleBatch | None) -> bool:
        """Two consecutive prefills do not overlap: the first one's tokens come out sooner (TTFT)."""
        last = self.state.last_batch
        return (
            batch is not None
            and batch.forward_mode.is_prefill()
            and last is not None
            and last.forward_mode.is_prefill()
        )


__all__ = ["Scheduler"]
