"""The handles the scheduler holds per transfer, and the `fake` backend.

A KV sender (prefill side) and a KV receiver (decode side) each wrap one room's TransferStatus;
the scheduler polls them every step and never blocks on the network (the I/O threads of
tcp_prefill / tcp_decode do). `fake` moves nothing: a prefill finishes as soon as its KV is
computed and a decode "receives" no KV and no first token (SGLang's warm-up and health-probe
backend; its decode output is meaningless).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from radixserve.disaggregation.utils import KVPoll, TransferStatus


class KVSender(Protocol):
    room: int
    status: TransferStatus

    def poll(self) -> KVPoll: ...
    def send(self, kv: torch.Tensor, meta: dict[str, Any]) -> None: ...
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


class KVReceiver(Protocol):
    room: int
    status: TransferStatus

    def poll(self) -> KVPoll: ...
    def init(self, num_tokens: int) -> None: ...
    def result(self) -> tuple[dict[str, Any], memoryview | None]: ...
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


class FakeSender:
    def __init__(self, room: int, timeout_s: float) -> None:
        self.room = room
        self.status = TransferStatus(timeout_s)
        self.status.advance(KVPoll.WaitingForInput)  # no decode side to wait for

    def poll(self) -> KVPoll:
        return self.status.poll()

    def send(self, kv: torch.Tensor, meta: dict[str, Any]) -> None:
        self.status.advance(KVPoll.Success)

    def abort(self, reason: str) -> None:
        self.status.fail(reason)

    def close(self) -> None:
        return None


class FakeReceiver:
    def __init__(self, room: int, timeout_s: float) -> None:
        self.room = room
        self.status = TransferStatus(timeout_s)
        self.status.advance(KVPoll.WaitingForInput)

    def poll(self) -> KVPoll:
        return self.status.poll()

    def init(self, num_tokens: int) -> None:
        self.status.advance(KVPoll.Success)

    def result(self) -> tuple[dict[str, Any], memoryview | None]:
        return {"type": "kv", "first_token": None}, None

    def abort(self, reason: str) -> None:
        self.status.fail(reason)

    def close(self) -> None:
        return None
