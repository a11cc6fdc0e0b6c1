"""TokenizerManager: the main process's asyncio front of the scheduler.

It tokenizes and validates requests, sends them to the scheduler, and turns the detokenizer's
BatchStrOut messages (or, with --detokenizer inline, the scheduler's BatchTokenIDOut, decoded here)
into per-request state that HTTP handlers and the Engine await. All of its
methods run on one event loop (uvicorn's, or the Engine's private loop thread); tokenization, chat
templates and grammar checks run on a small thread pool (`run_blocking`) so a huge prompt never
stalls that loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import zmq

from radixserve.constrained.validation import prewarm as prewarm_grammar
from radixserve.managers.control_client import ControlClient
from radixserve.managers.crash_dump import CrashDump
from radixserve.managers.detokenizer_manager import inline_detokenizer
from radixserve.managers.embedding_request import EmbedItem, prepare_embedding_items
from radixserve.managers.errors import ClientDisconnected, RequestAbortedError
from radixserve.managers.generate_request import GenerateReqInput, RequestItem
from radixserve.managers.input_validation import (
    InvalidRequestError,
    ModelLimits,
    check_encode_kind,
    expand_generate,
    prepare_prompts,
)
from radixserve.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOut,
    BatchStrOut,
    BatchTokenIDOut,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    FinishAbort,
    FinishReason,
    FlushCacheReqInput,
    GetInternalStateReq,
    GetLoadReqInput,
    MultimodalPayload,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TypeBasedDispatcher,
    rid_matches,
)
from radixserve.managers.lora_registry import LoRARegistry
from radixserve.managers.output_applier import apply_batch_str_out
from radixserve.managers.progress_waiter import ProgressWaiter
from radixserve.managers.quarantine import Quarantine
from radixserve.managers.req_state import ReqState, build_embedding_output, build_output, embedding_item
from radixserve.managers.request_logger import RequestLogger
from radixserve.managers.request_metrics import observe_finish, observe_load, observe_output
from radixserve.managers.socket_reader import SocketReader
from radixserve.multimodal.media_fetch import MediaFetcher
from radixserve.multimodal.processor import load_image_processor
from radixserve.server_args import ServerArgs
from radixserve.utils.metrics import ServerMetrics
from radixserve.utils.network import PortArgs, get_zmq_socket
from radixserve.utils.tracing import RequestTracer, tokenize_span

logger = logging.getLogger(__name__)
# What the scheduler's message takes from the request item unchanged: the fields both name alike
# (input_ids: the item's as given, the message's as tokenized).
_FROM_ITEM = tuple(
    {f.name for f in dataclasses.fields(TokenizedGenerateReqInput)}
    & {f.name for f in dataclasses.fields(RequestItem)} - {"input_ids"}
)
T = TypeVar("T")

# How often a waiting request checks whether its HTTP client went away.
DISCONNECT_POLL_S = 0.5
# An aborted request stays in flight until the scheduler's final output (with the tokens generated
# so far) arrives; this bounds the wait should that output never come.
ABORT_GRACE_S = 10.0
# Threads that tokenize off the event loop. HF fast tokenizers release the GIL while encoding, so
# two prompts tokenize in parallel while the loop keeps serving.
TOKENIZER_THREADS = 2


class ClientRequest(Protocol):
    async def is_disconnected(self) -> bool: ...


class TokenizerManager:
    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict[str, Any], tokenizer: Any
    ) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.tokenizer = tokenizer
        self.model_path = server_args.model_path or ""
        self.served_model_name = server_args.served_model_name or self.model_path
        self.context_len = int(scheduler_info["context_len"])
        self.max_req_input_len = int(scheduler_info.get("max_req_input_len", self.context_len - 1))
        self.vocab_size = int(scheduler_info.get("vocab_size", len(tokenizer)))
        # Embedding / classification models (seed 000 §17): what they return, as the scheduler
        # reported it (configs/pooling.py); None for generation models.
        self.is_generation = bool(scheduler_info.get("is_generation", True))
        self.images = load_image_processor(server_args.model_path)  # None: a text-only model
        self.media = MediaFetcher.of(server_args)  # image URLs, fetched on this loop
        self.limits = ModelLimits.of(server_args, scheduler_info, self.vocab_size, self.images)
        self.embedding_info: dict[str, Any] | None = scheduler_info.get("embedding")
        self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="radixserve-tokenize")
        self.max_total_num_tokens = int(scheduler_info.get("max_total_num_tokens", self.context_len))
        # Every scheduler rank (tp/pp index, node, pid, cores) as rank 0 gathered them at start.
        self.ranks: list[dict[str, Any]] = scheduler_info.get("ranks") or [
            {"rank": 0, "tp_rank": 0, "pp_rank": 0, "node_rank": 0, "pid": scheduler_info.get("pid")}
        ]
        self.dp_size = server_args.dp_size
        self.metrics = (
            ServerMetrics(
                self.max_total_num_tokens * self.dp_size,
                self.dp_size,
                speculative=server_args.speculative_algorithm is not None,
                model_name=self.served_model_name,
            )
            if server_args.enable_metrics
            else None
        )
        self.request_logger = RequestLogger(server_args.log_requests, server_args.log_requests_level)
        self.tracer = RequestTracer.from_server_args(server_args)  # None unless --enable-trace
        self.crash_dump = CrashDump.from_server_args(server_args)  # None without --crash-dump-folder
        self.rid_to_state: dict[str, ReqState] = {}
        self._started = False
        self._closed = False  # after close(): sockets gone, nothing more is sent
        self.weight_version = server_args.weight_version  # reported in every meta_info
        self.control = ControlClient(
            self._send_to_scheduler, self.dp_size, self._raise_if_dead, self._on_new_weights
        )
        self._reader: SocketReader | None = None
        # LoRA adapters by name, load and unload (managers/lora_registry.py).
        self.lora = LoRARegistry(
            server_args, self.control.ask, lambda: [s.item.lora_id for s in self.rid_to_state.values()]
        )
        self.dead_reason: str | None = None
        # With --restart-on-failure: requests in flight at two crashes are refused (quarantine.py).
        self.quarantine = Quarantine() if server_args.restart_on_failure else None
        # time.monotonic() of the last output from the scheduler: /health_generate's evidence of
        # progress (entrypoints/health.py); none yet at start.
        self.last_output_time = float("-inf")
        # --detokenizer inline: the scheduler's step messages come here and are decoded on this
        # loop (no detokenizer process woken per token); None: BatchStrOut from the process.
        self._detokenizer = inline_detokenizer(tokenizer) if server_args.detokenizer == "inline" else None
        self._dispatch = TypeBasedDispatcher(
            [
                (BatchStrOut, self._on_batch_str_out),
                (BatchTokenIDOut, self._on_batch_token_id_out),
                (BatchEmbeddingOut, self._on_batch_embedding_out),
                (AbortReq, self._on_abort),
            ]
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Open the sockets and start the receive loop; call from the event loop that serves."""
        self._sync_ctx = zmq.Context(1)
        self._send = get_zmq_socket(
            self._sync_ctx, zmq.PUSH, self.port_args.scheduler_input_ipc_name, bind=False
        )
        self._recv = get_zmq_socket(self._sync_ctx, zmq.PULL, self.port_args.tokenizer_ipc_name, bind=True)
        self._started = True
        self._reader = SocketReader(self._recv, self._on_message)
        self._reader.start(asyncio.get_running_loop())
        prewarm_grammar()

    async def close(self) -> None:
        """Stop receiving, then close the sockets and their contexts, in that order: a socket
        closed under a pending recv, or sent on once closed, raises ZMQError."""
        self._closed = True  # later aborts (a cancelled stream's cleanup) send nothing
        if self._reader is not None:
            self._reader.stop()
        for sock in (self._send, self._recv):
            sock.close(linger=0)
        self._sync_ctx.term()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.tracer is not None:
            self.tracer.shutdown()  # export the spans still buffered

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-heavy work (tokenizing, chat templates, grammar checks) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def fail_all(self, message: str, status_code: int = 503) -> None:
        """Finish every in-flight request with an error (a child process died, or the shutdown
        drain's deadline passed); later requests are refused with the same message."""
        self.dead_reason = message
        for state in list(self.rid_to_state.values()):
            self._finish(state, FinishAbort(message, status_code))
        self._update_load_metrics()

    def reconnect_scheduler(self) -> None:
        """A new socket to the scheduler's input (it is restarting): what the old one still queued
        for the dead scheduler (requests already failed here) must not reach the new one."""
        self._send.close(linger=0)
        self._send = get_zmq_socket(
            self._sync_ctx, zmq.PUSH, self.port_args.scheduler_input_ipc_name, bind=False
        )

    # ------------------------------------------------------------------ generation
    async def generate(
        self, obj: GenerateReqInput, request: ClientRequest | None = None
    ) -> dict | list[dict]:
        """Run to completion; a dict for a single prompt with n == 1, else a list in input order."""
        states = await self._submit(obj, stream=False)
        await self._run_to_completion(states, request)
        outputs = [self._output(s) for s in states]
        return outputs[0] if obj.is_single and len(outputs) == 1 else outputs

    async def stream(
        self, obj: GenerateReqInput, request: ClientRequest | None = None
    ) -> AsyncIterator[dict]:
        """Submit now (so validation errors raise before any response starts), then return an
        iterator yielding an output dict (cumulative text, with "index") on each item's progress."""
        return self._stream_states(await self._submit(obj, stream=True), request)

    async def _stream_states(
        self, states: list[ReqState], request: ClientRequest | None
    ) -> AsyncIterator[dict]:
        waiter = ProgressWaiter(states[0].group_event, DISCONNECT_POLL_S)
        try:
            while True:
                await self._wait(waiter, states, request)
                for state in states:
                    if state.dirty:
                        state.dirty = False
                        yield self._output(state)
                # The receive task runs while we are suspended in `yield`: a state may have finished
                # (and become dirty) since it was last yielded, so leave only when none is unseen.
                if all(s.finished and not s.dirty for s in states):
                    return
        except asyncio.CancelledError:
            # The HTTP server cancels a stream whose client went away (our own poll in _wait
            # raises ClientDisconnected instead); either way one log line, then the abort.
            if not all(s.finished for s in states):
                logger.info("Client disconnected; aborting %s", [s.rid for s in states if not s.finished])
            raise
        finally:
            waiter.close()
            self._abort_unfinished(states)

    async def _submit(self, obj: GenerateReqInput, stream: bool) -> list[ReqState]:
        """Tokenize and validate every item first, so a bad item rejects the whole call."""
        self._raise_if_dead()
        items = await self.media.resolve(self.lora.resolve(expand_generate(self.limits, obj)))
        if self.server_args.disaggregation_mode == "decode":
            # Prompt logprobs come from the prefill server (a PD router merges them); this side
            # reports none, so the merged list has each prompt position once.
            items = [dataclasses.replace(item, logprob_start_len=-1) for item in items]
        with tokenize_span(self.tracer):
            prompts = await self.run_blocking(
                prepare_prompts, self.tokenizer, self.limits, items, self.images
            )
        self._raise_if_dead()  # a child may have died while we tokenized
        group_event = asyncio.Event()
        states = [ReqState(item, ids, group_event) for item, (ids, _) in zip(items, prompts)]
        for state in states:
            if state.rid in self.rid_to_state:
                raise InvalidRequestError(f"Duplicate request id {state.rid!r}.")
            if self.tracer is not None:
                state.trace = self.tracer.start_request(state.rid)
        received = time.time()
        for state in states:
            self.request_logger.log_received(state)
        reqs = [self._tokenized(state, stream, received, mm) for state, (_, mm) in zip(states, prompts)]
        self._send_states(states, reqs, BatchTokenizedGenerateReqInput)
        return states

    def _send_states(self, states: list[ReqState], reqs: list[Any], batch_type: type) -> None:
        """Track `states` and send their requests, in one `batch_type` message when several."""
        if self.quarantine is not None:
            self.quarantine.admit(reqs)
        if self.crash_dump is not None:
            self.crash_dump.record(reqs)
        for state in states:
            self.rid_to_state[state.rid] = state
        self._send.send_pyobj(reqs[0] if len(reqs) == 1 else batch_type(reqs=reqs))
        self._update_load_metrics()

    async def _run_to_completion(self, states: list[ReqState], request: ClientRequest | None) -> None:
        waiter = ProgressWaiter(states[0].group_event, DISCONNECT_POLL_S)
        try:
            while not all(s.finished for s in states):
                await self._wait(waiter, states, request)
        finally:
            waiter.close()
            self._abort_unfinished(states)

    # ------------------------------------------------------------------ prefill-only requests
    async def encode_items(self, items: list[EmbedItem], request: ClientRequest | None = None) -> list[dict]:
        """Run embedding / classification / label-scoring items to completion; outputs in order.

        Plain embeddings need an embedding model, label scores a generation model (its LM head):
        the other asks are 400s. An item that fails (queue full, server error) fails the call."""
        self._raise_if_dead()
        check_encode_kind(self.limits, [i.label_token_ids is not None for i in items])
        tokenized = await self.run_blocking(prepare_embedding_items, self.tokenizer, self.limits, items)
        self._raise_if_dead()
        group_event = asyncio.Event()
        states = [
            ReqState(embedding_item(i, item.rid, item.text, item.priority), ids, group_event)
            for i, (item, (ids, _)) in enumerate(zip(items, tokenized))
        ]
        if any(s.rid in self.rid_to_state for s in states):
            raise InvalidRequestError("Duplicate request id.")
        received = time.time()
        reqs = [
            TokenizedEmbeddingReqInput(
                item.rid, item.text or "", ids, types, item.label_token_ids, item.priority, received
            )
            for item, (ids, types) in zip(items, tokenized)
        ]
        self._send_states(states, reqs, BatchTokenizedEmbeddingReqInput)
        await self._run_to_completion(states, request)
        return [build_embedding_output(s) for s in states]

    def _on_batch_embedding_out(self, msg: BatchEmbeddingOut) -> None:
        self.last_output_time = time.monotonic()
        for i, rid in enumerate(msg.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                continue
            state.embedding = msg.embeddings[i]
            state.prompt_tokens = msg.prompt_tokens[i]
            state.cached_tokens = msg.cached_tokens[i]
            if msg.queue_times is not None:
                state.queue_time = msg.queue_times[i]
            self._finish(state, msg.finished_reasons[i])
        self._update_load_metrics()

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise RequestAbortedError(self.dead_reason, 503)

    @staticmethod
    def _tokenized(
        state: ReqState, stream: bool, received: float, mm: MultimodalPayload | None = None
    ) -> TokenizedGenerateReqInput:
        return TokenizedGenerateReqInput(
            **{name: getattr(state.item, name) for name in _FROM_ITEM},
            input_text=state.item.text or "",
            input_ids=state.input_ids,
            # Non-streaming requests get one message at the end instead of one per step.
            stream=stream,
            received_time=received,
            mm_inputs=mm,
            trace=state.trace.context if state.trace is not None else None,
        )

    async def _wait(
        self, waiter: ProgressWaiter, states: list[ReqState], request: ClientRequest | None
    ) -> None:
        """Wait for progress on any of `states` (or a poll: callers re-check their states); abort
        them if a poll finds the client disconnected. One timer per call, not per chunk
        (managers/progress_waiter.py)."""
        if await waiter.wait() or request is None:
            return
        if await request.is_disconnected():
            logger.info("Client disconnected; aborting %s", [s.rid for s in states if not s.finished])
            self._abort_unfinished(states)
            raise ClientDisconnected()

    def _abort_unfinished(self, states: list[ReqState]) -> None:
        for state in states:
            if not state.finished:
                self.abort_request(state.rid)

    def _output(self, state: ReqState) -> dict:
        decode = None
        if state.item.return_logprob and state.item.return_text_in_logprobs:

            def decode(tok: int) -> str:
                return self.tokenizer.decode([tok])

        out = build_output(state, decode)
        out["meta_info"]["weight_version"] = self.weight_version
        return out

    # ------------------------------------------------------------------ aborts and control
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Tell the scheduler to stop `rid` (its n > 1 samples "rid-i" too) or everything.

        The scheduler answers with each request's final output (finish_reason abort, the tokens so
        far), which finishes it here as any other output does, so a non-streaming caller gets the
        partial text; if that never arrives within ABORT_GRACE_S the request is finished locally."""
        if not self._closed:
            self._send.send_pyobj(AbortReq(rid=rid or "", abort_all=abort_all))
        targets = [s for key, s in self.rid_to_state.items() if abort_all or (rid and rid_matches(key, rid))]
        if not targets:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop to wait on: finish now
            loop = None
        for state in targets:
            if loop is None:
                self._finish(state, FinishAbort("Aborted by request."))
            else:
                loop.call_later(ABORT_GRACE_S, self._finish_abandoned, state)

    def _finish_abandoned(self, state: ReqState) -> None:
        if self.rid_to_state.get(state.rid) is state:
            logger.warning("No final output for aborted request %s; finishing it locally", state.rid)
            self._finish(state, FinishAbort("Aborted by request."))
            self._update_load_metrics()

    @property
    def num_in_flight(self) -> int:
        return len(self.rid_to_state)

    async def flush_cache(self) -> bool:
        outputs = await self.control.ask_all(FlushCacheReqInput())
        return all(o.success for o in outputs)

    async def get_internal_states(self) -> list[dict[str, Any]]:
        """One state per data-parallel replica, in dp_rank order."""
        outputs = await self.control.ask_all(GetInternalStateReq())
        states = [{"dp_rank": 0, **o.internal_state} for o in outputs]
        return sorted(states, key=lambda st: st["dp_rank"])

    async def get_load(self) -> list[dict[str, Any]]:
        """SGLang's /get_load: one entry per replica (dp_rank, num_reqs, num_waiting_reqs,
        num_tokens), in dp_rank order."""
        outputs = await self.control.ask_all(GetLoadReqInput())
        return [dataclasses.asdict(o) for o in sorted(outputs, key=lambda o: o.dp_rank)]

    def _send_to_scheduler(self, msg: object) -> None:
        assert self._started, "start() was not called"
        self._send.send_pyobj(msg)

    def _on_new_weights(self, weight_version: str | None, model_path: str | None) -> None:
        """A control request loaded new weights: later outputs and /get_model_info say so."""
        if weight_version is not None:
            self.weight_version = weight_version
        if model_path is not None:
            self.model_path = model_path

    # ------------------------------------------------------------------ receiving
    def _on_message(self, msg: object) -> None:
        """Every message from the detokenizer and the scheduler (SocketReader logs a failure)."""
        if not self.control.deliver(msg):  # a control reply stops there
            self._dispatch(msg)

    def _on_batch_str_out(self, msg: BatchStrOut) -> None:
        self.last_output_time = time.monotonic()
        now = time.perf_counter()
        for state, num_new, first, reason in apply_batch_str_out(msg, self.rid_to_state, now):
            state.dp_rank = msg.dp_rank
            if self.metrics is not None:
                observe_output(self.metrics, state, num_new, first, now)
            state.last_token_time = now
            if reason is not None:
                self._finish(state, reason)
            else:
                state.mark_dirty()
        self._update_load_metrics()

    def _on_batch_token_id_out(self, msg: BatchTokenIDOut) -> None:
        if self._detokenizer is None:  # a scheduler and a tokenizer manager that disagree: a bug
            raise ValueError("BatchTokenIDOut reached the tokenizer manager without --detokenizer inline")
        self._on_batch_str_out(self._detokenizer.handle(msg))

    def _on_abort(self, msg: AbortReq) -> None:
        """The scheduler dropped a request without a final output for it."""
        state = self.rid_to_state.get(msg.rid)
        if state is not None:
            self._finish(state, FinishAbort("Aborted by the scheduler."))
            self._update_load_metrics()  # the in-flight gauges must not keep a finished request

    def _finish(self, state: ReqState, reason: FinishReason) -> None:
        if self.rid_to_state.get(state.rid) is not state:
            return  # already finished (the rid may since belong to a new request)
        del self.rid_to_state[state.rid]
        if self._detokenizer is not None:
            # Its decode state, when no finished message will free it (a scheduler lost in a crash).
            self._detokenizer.states.pop(state.rid, None)
        state.finish(reason)
        if self.quarantine is not None:
            self.quarantine.finished(state.rid, ok=not isinstance(reason, FinishAbort))
        self.request_logger.log_finished(state)
        if self.metrics is not None:
            observe_finish(self.metrics, state, reason)
        if state.trace is not None:
            state.trace.finish(state, reason)

    def _update_load_metrics(self) -> None:
        if self.metrics is not None:
            observe_load(self.metrics, self.rid_to_state.values())

    # ------------------------------------------------------------------ tokenizer helpers
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
