"""The Engine's end of the scheduler's RPC channel (seed 002 §3.1): `RpcReqInput` out, the
matching `RpcReqOutput` back, one call at a time, on a DEALER socket of its own."""

from __future__ import annotations

import threading
from typing import Any

import zmq

from radixserve.managers.io_struct import RpcReqInput, RpcReqOutput
from radixserve.utils.network import get_zmq_socket

RPC_TIMEOUT_MS = 60_000


class RpcError(RuntimeError):
    """The scheduler refused or failed the call; the message says why."""


class RpcClient:
    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context(1)
        self._sock = get_zmq_socket(self._context, zmq.DEALER, endpoint, bind=False)
        self._lock = threading.Lock()

    def call(self, method: str, parameters: dict[str, Any] | None = None) -> Any:  # noqa: ANN401
        with self._lock:
            self._sock.send_pyobj(RpcReqInput(method, parameters or {}))
            if not self._sock.poll(RPC_TIMEOUT_MS):
                raise TimeoutError(f"RPC {method} got no reply in {RPC_TIMEOUT_MS / 1000:.0f} s")
            out: RpcReqOutput = self._sock.recv_pyobj()
        if not out.success:
            raise RpcError(out.message)
        return out.result

    def close(self) -> None:
        self._sock.close(linger=0)
        self._context.term()
