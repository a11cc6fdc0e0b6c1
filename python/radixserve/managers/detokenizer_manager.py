"""The Detokenizer process: BatchTokenIDOut (token ids per step) -> BatchStrOut (text per step).

It keeps one `DecodeState` per live rid and frees it when the scheduler reports the request
finished. It never ends a request: the scheduler matches stop strings, the detokenizer only
withholds what may begin one and cuts the text where the scheduler's finish reason says.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import zmq

from radixserve.managers.decode_tokenizer import DecodeSpec, decode_spec
from radixserve.managers.detokenizer import DecodeState, TokenDecoder
from radixserve.managers.io_struct import (
    PARTIAL_CHAR_DROPPED,
    BatchStrOut,
    BatchTokenIDOut,
    FinishMatchedStr,
    FinishMatchedToken,
    FinishReason,
    StepOutputs,
)
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs, get_zmq_socket
from radixserve.utils.process import limit_threads

logger = logging.getLogger(__name__)

__all__ = ["PARTIAL_CHAR_DROPPED", "DetokenizerManager", "inline_detokenizer", "run_detokenizer_process"]


class DetokenizerManager:
    """Pure message-in/message-out core, testable without sockets."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoders: dict[tuple[bool, bool], TokenDecoder] = {}
        self.states: dict[str, DecodeState] = {}

    def _decoder(self, skip: bool, spaces: bool) -> TokenDecoder:
        key = (skip, spaces)
        if key not in self._decoders:
            self._decoders[key] = TokenDecoder(self.tokenizer, skip, spaces)
        return self._decoders[key]

    def handle(self, msg: BatchTokenIDOut) -> BatchStrOut:
        texts: list[str] = []
        reasons: list[FinishReason | None] = []
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:
                decode = self._decoder(msg.skip_special_tokens[i], msg.spaces_between_special_tokens[i])
                state = self.states[rid] = DecodeState(decode, msg.stop_strs[i], msg.no_stop_trim[i])
            reason = msg.finished_reasons[i]
            if reason is not None:
                del self.states[rid]  # the scheduler is done with it: free the state
            text, reason = self._step(state, msg.output_ids[i], reason, msg.no_stop_trim[i])
            texts.append(text)
            reasons.append(reason)
        return _batch_str_out(msg, texts, reasons)

    @staticmethod
    def _step(
        state: DecodeState, new_ids: Sequence[int], reason: FinishReason | None, no_stop_trim: bool
    ) -> tuple[str, FinishReason | None]:
        ids = list(new_ids)
        if isinstance(reason, FinishMatchedToken) and not no_stop_trim and ids:
            ids = ids[:-1]  # a matched stop token is not part of the text
        stop = reason.matched if isinstance(reason, FinishMatchedStr) else None
        text = state.step(ids, finished=reason is not None, matched_stop=stop)
        if reason is not None and state.partial_char_dropped:
            # The client hears what the text lacks.
            reason = dataclasses.replace(reason, partial_char_dropped=True)
        return text, reason


def _batch_str_out(msg: BatchTokenIDOut, texts: list[str], reasons: list[FinishReason | None]) -> BatchStrOut:
    # Everything the two messages share passes through as it is, but the finish reasons.
    shared = {f.name: getattr(msg, f.name) for f in dataclasses.fields(StepOutputs)}
    return BatchStrOut(**{**shared, "finished_reasons": reasons}, output_strs=texts)


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, spec: DecodeSpec | None, pipe: Connection
) -> None:
    """Process entry: load the tokenizer, report ready, then translate messages forever."""
    limit_threads()
    try:
        manager = DetokenizerManager(load_decode_tokenizer(server_args, spec))
        context = zmq.Context(2)
        recv = get_zmq_socket(context, zmq.PULL, port_args.detokenizer_ipc_name, bind=True)
        send_out = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)
    except Exception as exc:
        pipe.send({"status": "error", "message": f"detokenizer failed to start: {exc!r}"})
        raise
    pipe.send({"status": "ready"})
    while True:
        msg = recv.recv_pyobj()
        if not isinstance(msg, BatchTokenIDOut):
            logger.error("Detokenizer got an unexpected %s", type(msg).__name__)
            continue
        send_out.send_pyobj(manager.handle(msg))


def inline_detokenizer(tokenizer: Any) -> DetokenizerManager:
    """The detokenizer's core for the tokenizer manager's own loop (--detokenizer inline): over a
    backend rebuilt from the loaded tokenizer's spec, as the process would decode (and not shared
    with the threads that encode prompts), else over the HF tokenizer itself, as the process falls
    back to."""
    spec = decode_spec(tokenizer)
    if spec is None:
        return DetokenizerManager(tokenizer)
    from radixserve.managers.decode_tokenizer import BackendDecoder

    return DetokenizerManager(BackendDecoder(spec))


def load_decode_tokenizer(server_args: ServerArgs, spec: DecodeSpec | None) -> Any:
    """The tokenizer backend the parent handed over, when it has proven it decodes alike (no
    torch, no transformers here: managers/decode_tokenizer.py); else the HF tokenizer."""
    if spec is not None:
        from radixserve.managers.decode_tokenizer import BackendDecoder

        return BackendDecoder(spec)
    from radixserve.managers.hf_tokenizer import load_tokenizer

    return load_tokenizer(server_args)
