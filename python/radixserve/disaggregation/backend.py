"""The handles the scheduler holds per transfer, and the `fake` backend.

A KV sender (prefill side) and a KV receiver (decode side) each wrap one room's TransferStatus;
the scheduler polls them every step and never blocks on the network (the I/O threads of
tcp_prefill / tcp_decode do). `fake` moves nothing: a prefill finishes as soon as its KV is
computed and a decode "receives" no KV and no first token (SGLang's warm-up and health-probe
backend; its decode output is meaningless).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from radixserve.disaggregation.utils import KVPoll, TransferStatus

# What a sender calls to copy the prompt's K and V of this rank's local KV heads [a, b) out of the
# pool (wire.gather_kv on the request's slots); it calls it once per decode rank that wants heads.
GatherKV = Callable[[tuple[int, int]], torch.Tensor]
# What a receiver hands over on Success: the first message's metadata (first token, logprobs) and
# every (kv message, payload) that carries KV heads.
KVResult = tuple[dict[str, Any], list[tuple[dict[str, Any], memoryview]]]


class KVSender(Protocol):
    room: int
    status: TransferStatus

    def poll(self) -> KVPoll: ...
    def send(self, meta: dict[str, Any], gather: GatherKV) -> None: ...
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


class KVReceiver(Protocol):
    room: int
    status: TransferStatus

    def poll(self) -> KVPoll: ...
    def init(self, num_tokens: int) -> None: ...
    def result(self) -> KVResult: ...
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


class RoomHandle:
    """What every sender and receiver holds: its room and the room's TransferStatus."""

    def __init__(self, room: int, status: TransferStatus) -> None:
        self.room = room
        self.status = status

    def poll(self) -> KVPoll:
        return self.status.poll()


class FakeSender(RoomHandle):
    def __init__(self, room: int, timeout_s: float) -> None:
        super().__init__(room, TransferStatus(timeout_s))
        self.status.advance(KVPoll.WaitingForInput)  # no decode side to wait for

    def send(self, meta: dict[str, Any], gather: GatherKV) -> None:
        self.status.advance(KVPoll.Success)

    def abort(self, reason: str) -> None:
        self.status.fail(reason)

    def close(self) -> None:
        return None


class FakeReceiver(RoomHandle):
    def __init__(self, room: int, timeout_s: float) -> None:
        super().__init__(room, TransferStatus(timeout_s))
        self.status.advance(KVPoll.WaitingForInput)

    def init(self, num_tokens: int) -> None:
        self.status.advance(KVPoll.Success)

    def result(self) -> KVResult:
        return {"type": "kv", "first_token": None}, []

    def abort(self, reason: str) -> None:
        self.status.fail(reason)

    def close(self) -> None:
        return None
