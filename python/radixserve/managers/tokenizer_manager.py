"""TokenizerManager: the main process's asyncio front of the scheduler.

It tokenizes and validates requests, sends them to the scheduler, and turns the detokenizer's
BatchStrOut messages into per-request state that HTTP handlers and the Engine await. All of its
methods run on one event loop (uvicorn's, or the Engine's private loop thread); tokenization, chat
templates and grammar checks run on a small thread pool (`run_blocking`) so a huge prompt never
stalls that loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import zmq
import zmq.asyncio

from radixserve.constrained.validation import prewarm as prewarm_grammar
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.input_validation import InvalidRequestError, ModelLimits, prepare_items
from radixserve.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    BatchTokenizedGenerateReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
    TypeBasedDispatcher,
    rid_matches,
)
from radixserve.managers.output_applier import apply_batch_str_out
from radixserve.managers.req_state import ReqState, build_output
from radixserve.managers.request_logger import RequestLogger
from radixserve.server_args import ServerArgs
from radixserve.utils.metrics import ServerMetrics
from radixserve.utils.network import PortArgs, get_zmq_socket

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How often a waiting request checks whether its HTTP client went away.
DISCONNECT_POLL_S = 0.5
# An aborted request stays in flight until the scheduler's final output (with the tokens generated
# so far) arrives; this bounds the wait should that output never come.
ABORT_GRACE_S = 10.0
CONTROL_TIMEOUT_S = 30.0
# Threads that tokenize off the event loop. HF fast tokenizers release the GIL while encoding, so
# two prompts tokenize in parallel while the loop keeps serving.
TOKENIZER_THREADS = 2


class RequestAbortedError(RuntimeError):
    """A request the server could not serve; `status_code` is the HTTP status to answer."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.status_code = status_code


class ClientDisconnected(Exception):
    """The HTTP client of a waiting call went away; its requests were aborted (logged once)."""


class ClientRequest(Protocol):
    async def is_disconnected(self) -> bool: ...


def load_tokenizer(server_args: ServerArgs) -> Any:
    """The HF tokenizer of the model folder, with --chat-template applied (a file or a string)."""
    from transformers import AutoTokenizer

    path = server_args.tokenizer_path or server_args.model_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = server_args.chat_template
    if template:
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        tokenizer.chat_template = template
    return tokenizer


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
        self.limits = ModelLimits(self.vocab_size, self.context_len, self.max_req_input_len)
        self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="radixserve-tokenize")
        self.max_total_num_tokens = int(scheduler_info.get("max_total_num_tokens", self.context_len))
        # Every scheduler rank (tp/pp index, node, pid, cores) as rank 0 gathered them at start.
        self.ranks: list[dict[str, Any]] = scheduler_info.get("ranks") or [
            {"rank": 0, "tp_rank": 0, "pp_rank": 0, "node_rank": 0, "pid": scheduler_info.get("pid")}
        ]
        self.metrics = ServerMetrics(self.max_total_num_tokens) if server_args.enable_metrics else None
        self.request_logger = RequestLogger(server_args.log_requests, server_args.log_requests_level)
        self.rid_to_state: dict[str, ReqState] = {}
        self._control_waiters: dict[type, list[asyncio.Future[Any]]] = {}
        self._control_lock: asyncio.Lock | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self.dead_reason: str | None = None
        self._dispatch = TypeBasedDispatcher(
            [
                (BatchStrOut, self._on_batch_str_out),
                (AbortReq, self._on_abort),
                (FlushCacheReqOutput, self._on_control_output),
                (GetInternalStateReqOutput, self._on_control_output),
            ]
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Open the sockets and start the receive loop; call from the event loop that serves."""
        self._sync_ctx = zmq.Context(1)
        self._send = get_zmq_socket(
            self._sync_ctx, zmq.PUSH, self.port_args.scheduler_input_ipc_name, bind=False
        )
        self._async_ctx = zmq.asyncio.Context(1)
        self._recv = get_zmq_socket(self._async_ctx, zmq.PULL, self.port_args.tokenizer_ipc_name, bind=True)
        self._control_lock = asyncio.Lock()
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())
        prewarm_grammar()

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        for sock in (self._send, self._recv):
            sock.close(linger=0)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-heavy work (tokenizing, chat templates, grammar checks) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def fail_all(self, message: str, status_code: int = 503) -> None:
        """Finish every in-flight request with an error (a child process died)."""
        self.dead_reason = message
        for state in list(self.rid_to_state.values()):
            self._finish(state, {"type": "abort", "message": message, "status_code": status_code})
        self._update_load_metrics()

    # ------------------------------------------------------------------ generation
    async def generate(
        self, obj: GenerateReqInput, request: ClientRequest | None = None
    ) -> dict | list[dict]:
        """Run to completion; a dict for a single prompt with n == 1, else a list in input order."""
        states = await self._submit(obj, stream=False)
        try:
            while not all(s.finished for s in states):
                await self._wait(states, request)
        finally:
            self._abort_unfinished(states)
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
        try:
            while True:
                await self._wait(states, request)
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
            self._abort_unfinished(states)

    async def _submit(self, obj: GenerateReqInput, stream: bool) -> list[ReqState]:
        """Tokenize and validate every item first, so a bad item rejects the whole call."""
        self._raise_if_dead()
        items = obj.expand()
        input_ids = await self.run_blocking(prepare_items, self.tokenizer, self.limits, items)
        self._raise_if_dead()  # a child may have died while we tokenized
        group_event = asyncio.Event()
        states = [ReqState(item, ids, group_event) for item, ids in zip(items, input_ids)]
        for state in states:
            if state.rid in self.rid_to_state:
                raise InvalidRequestError(f"Duplicate request id {state.rid!r}.")
        received = time.time()
        reqs = [self._tokenized(state, stream, received) for state in states]
        for state in states:
            self.rid_to_state[state.rid] = state
            self.request_logger.log_received(state)
        self._send.send_pyobj(reqs[0] if len(reqs) == 1 else BatchTokenizedGenerateReqInput(reqs=reqs))
        self._update_load_metrics()
        return states

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise RequestAbortedError(self.dead_reason, 503)

    @staticmethod
    def _tokenized(state: ReqState, stream: bool, received: float) -> TokenizedGenerateReqInput:
        item = state.item
        return TokenizedGenerateReqInput(
            rid=item.rid,
            input_text=item.text or "",
            input_ids=state.input_ids,
            sampling_params=item.sampling_params,
            return_logprob=item.return_logprob,
            logprob_start_len=item.logprob_start_len,
            top_logprobs_num=item.top_logprobs_num,
            priority=item.priority,
            # Non-streaming requests get one message at the end instead of one per step.
            stream=stream,
            received_time=received,
        )

    async def _wait(self, states: list[ReqState], request: ClientRequest | None) -> None:
        """Wait for progress on any of `states`; abort them if the client disconnected."""
        event = states[0].group_event
        while not event.is_set():
            try:
                await asyncio.wait_for(event.wait(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    logger.info("Client disconnected; aborting %s", [s.rid for s in states if not s.finished])
                    self._abort_unfinished(states)
                    raise ClientDisconnected() from None
        event.clear()

    def _abort_unfinished(self, states: list[ReqState]) -> None:
        for state in states:
            if not state.finished:
                self.abort_request(state.rid)

    def _output(self, state: ReqState) -> dict:
        decode = None
        if state.item.return_logprob and state.item.return_text_in_logprobs:

            def decode(tok: int) -> str:
                return self.tokenizer.decode([tok])

        return build_output(state, decode)

    # ------------------------------------------------------------------ aborts and control
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Tell the scheduler to stop `rid` (its n > 1 samples "rid-i" too) or everything.

        The scheduler answers with each request's final output (finish_reason abort, the tokens so
        far), which finishes it here as any other output does, so a non-streaming caller gets the
        partial text; if that never arrives within ABORT_GRACE_S the request is finished locally."""
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
                self._finish(state, {"type": "abort", "message": "Aborted by request.", "status_code": None})
            else:
                loop.call_later(ABORT_GRACE_S, self._finish_abandoned, state)

    def _finish_abandoned(self, state: ReqState) -> None:
        if self.rid_to_state.get(state.rid) is state:
            logger.warning("No final output for aborted request %s; finishing it locally", state.rid)
            self._finish(state, {"type": "abort", "message": "Aborted by request.", "status_code": None})
            self._update_load_metrics()

    @property
    def num_in_flight(self) -> int:
        return len(self.rid_to_state)

    async def flush_cache(self) -> bool:
        outputs = await self._control(FlushCacheReqInput(), FlushCacheReqOutput)
        return all(o.success for o in outputs)

    async def get_internal_states(self) -> list[dict[str, Any]]:
        outputs = await self._control(GetInternalStateReq(), GetInternalStateReqOutput)
        return [o.internal_state for o in outputs]

    async def _control(self, msg: Any, out_type: type) -> list[Any]:
        """Send a control request and await its reply (one at a time per kind of request)."""
        assert self._control_lock is not None, "start() was not called"
        async with self._control_lock:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._control_waiters.setdefault(out_type, []).append(future)
            self._send.send_pyobj(msg)
            return [await asyncio.wait_for(future, CONTROL_TIMEOUT_S)]

    # ------------------------------------------------------------------ receiving
    async def _recv_loop(self) -> None:
        while True:
            msg = await self._recv.recv_pyobj()
            try:
                self._dispatch(msg)
            except Exception:
                logger.exception("Failed to handle %s", type(msg).__name__)

    def _on_batch_str_out(self, msg: BatchStrOut) -> None:
        now = time.perf_counter()
        for state, num_new, first, reason in apply_batch_str_out(msg, self.rid_to_state, now):
            if self.metrics is not None:
                if first:
                    self.metrics.on_first_token(now - state.created_time, state.queue_time)
                self.metrics.on_tokens(num_new, None if first else now - (state.last_token_time or now))
            state.last_token_time = now
            if reason is not None:
                self._finish(state, reason)
            else:
                state.mark_dirty()
        self._update_load_metrics()

    def _on_abort(self, msg: AbortReq) -> None:
        """The scheduler dropped a request without a final output for it."""
        state = self.rid_to_state.get(msg.rid)
        if state is not None:
            self._finish(
                state, {"type": "abort", "message": "Aborted by the scheduler.", "status_code": None}
            )
            self._update_load_metrics()  # the in-flight gauges must not keep a finished request

    def _on_control_output(self, msg: Any) -> None:
        waiters = self._control_waiters.get(type(msg))
        if waiters:
            future = waiters.pop(0)
            if not future.done():
                future.set_result(msg)

    def _finish(self, state: ReqState, reason: dict[str, Any]) -> None:
        if self.rid_to_state.get(state.rid) is not state:
            return  # already finished (the rid may since belong to a new request)
        del self.rid_to_state[state.rid]
        state.finish(reason)
        self.request_logger.log_finished(state)
        if self.metrics is not None:
            self.metrics.on_finish(
                state.prompt_tokens or len(state.input_ids),
                state.cached_tokens,
                time.perf_counter() - state.created_time,
                aborted=reason.get("type") == "abort",
            )

    def _update_load_metrics(self) -> None:
        if self.metrics is None:
            return
        running = sum(1 for s in self.rid_to_state.values() if s.first_token_time is not None)
        tokens = sum(len(s.input_ids) + len(s.output_ids) for s in self.rid_to_state.values())
        self.metrics.set_load(running, len(self.rid_to_state) - running, tokens)

    # ------------------------------------------------------------------ tokenizer helpers
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool
    ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("The model has no chat template; pass --chat-template.")
        prompt = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
        )
        # The template already holds BOS and friends; adding them again would duplicate them.
        return self.tokenize(prompt, add_special_tokens=False)
