"""The Detokenizer process: BatchTokenIDOut (token ids per step) -> BatchStrOut (text per step).

It keeps one `DecodeState` per live rid and frees it when the scheduler reports the request
finished. When a stop string completes here before the scheduler noticed it, the request is
finished towards the client at once and an AbortReq tells the scheduler to stop generating.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import zmq

from radixserve.managers.detokenizer import DecodeState, TokenDecoder
from radixserve.managers.io_struct import AbortReq, BatchStrOut, BatchTokenIDOut
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs, get_zmq_socket
from radixserve.utils.process import limit_threads

logger = logging.getLogger(__name__)

# finish_reason key set when the output ended inside a multi-byte character (left out of the text).
PARTIAL_CHAR_DROPPED = "partial_char_dropped"


class _RidState:
    """A request's decode state, plus whether its text stream already ended."""

    def __init__(self, decode_state: DecodeState) -> None:
        self.decode_state = decode_state
        self.closed = False  # finished towards the client (stop string) before the scheduler said so


class DetokenizerManager:
    """Pure message-in/message-out core, testable without sockets."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoders: dict[tuple[bool, bool], TokenDecoder] = {}
        self.states: dict[str, _RidState] = {}

    def _decoder(self, skip: bool, spaces: bool) -> TokenDecoder:
        key = (skip, spaces)
        if key not in self._decoders:
            self._decoders[key] = TokenDecoder(self.tokenizer, skip, spaces)
        return self._decoders[key]

    def handle(self, msg: BatchTokenIDOut) -> tuple[BatchStrOut | None, list[str]]:
        """Return the BatchStrOut to forward (None if nothing to say) and rids to abort."""
        keep: list[int] = []
        texts: list[str] = []
        reasons: list[dict[str, Any] | None] = []
        to_abort: list[str] = []
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:
                decode = self._decoder(msg.skip_special_tokens[i], msg.spaces_between_special_tokens[i])
                min_new = msg.min_new_tokens[i] if msg.min_new_tokens is not None else 0
                state = self.states[rid] = _RidState(
                    DecodeState(decode, msg.stop_strs[i], msg.no_stop_trim[i], min_new)
                )
            reason = msg.finished_reasons[i]
            if reason is not None:
                del self.states[rid]  # the scheduler is done with it: free the state
            if state.closed:
                continue
            text, reason = self._step(state.decode_state, msg.output_ids[i], reason, msg.no_stop_trim[i])
            if reason is not None and msg.finished_reasons[i] is None:
                state.closed = True
                to_abort.append(rid)
            keep.append(i)
            texts.append(text)
            reasons.append(reason)
        if not keep:
            return None, to_abort
        return _batch_str_out(msg, keep, texts, reasons), to_abort

    @staticmethod
    def _step(
        state: DecodeState, new_ids: Sequence[int], reason: dict[str, Any] | None, no_stop_trim: bool
    ) -> tuple[str, dict[str, Any] | None]:
        ids = list(new_ids)
        if reason is not None and isinstance(reason.get("matched"), int) and not no_stop_trim and ids:
            ids = ids[:-1]  # a matched stop token is not part of the text
        text = state.step(ids, finished=reason is not None)
        if state.matched_stop is not None:
            # Our text-level match is authoritative for the text; report it as the finish cause.
            reason = {"type": "stop", "matched": state.matched_stop}
        elif reason is not None and state.partial_char_dropped:
            reason = {**reason, PARTIAL_CHAR_DROPPED: True}  # the client hears what the text lacks
        return text, reason


def _batch_str_out(
    msg: BatchTokenIDOut, keep: list[int], texts: list[str], reasons: list[dict[str, Any] | None]
) -> BatchStrOut:
    def pick(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else [values[i] for i in keep]

    optional = {
        f.name: pick(getattr(msg, f.name))
        for f in dataclasses.fields(BatchStrOut)
        if f.default is None  # the optional per-request lists, passed through as they are
    }
    return BatchStrOut(
        rids=[msg.rids[i] for i in keep],
        finished_reasons=reasons,
        output_strs=texts,
        output_ids=[msg.output_ids[i] for i in keep],
        prompt_tokens=[msg.prompt_tokens[i] for i in keep],
        completion_tokens=[msg.completion_tokens[i] for i in keep],
        cached_tokens=[msg.cached_tokens[i] for i in keep],
        dp_rank=msg.dp_rank,
        **optional,
    )


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, pipe: Connection) -> None:
    """Process entry: load the tokenizer, report ready, then translate messages forever."""
    limit_threads()
    from radixserve.managers.tokenizer_manager import load_tokenizer

    try:
        manager = DetokenizerManager(load_tokenizer(server_args))
        context = zmq.Context(2)
        recv = get_zmq_socket(context, zmq.PULL, port_args.detokenizer_ipc_name, bind=True)
        send_out = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)
        send_sched = get_zmq_socket(context, zmq.PUSH, port_args.scheduler_input_ipc_name, bind=False)
    except Exception as exc:
        pipe.send({"status": "error", "message": f"detokenizer failed to start: {exc!r}"})
        raise
    pipe.send({"status": "ready"})
    while True:
        msg = recv.recv_pyobj()
        if not isinstance(msg, BatchTokenIDOut):
            logger.error("Detokenizer got an unexpected %s", type(msg).__name__)
            continue
        out, to_abort = manager.handle(msg)
        if out is not None:
            send_out.send_pyobj(out)
        for rid in to_abort:
            send_sched.send_pyobj(AbortReq(rid=rid))
