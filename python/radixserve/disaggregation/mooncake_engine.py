"""The `mooncake` backend's data plane: Mooncake's TransferEngine over its TCP transport.

The control plane is the `tcp` backend's (bootstrap server, ZMQ init / kv / ack / fail messages,
replicas, TP heads, failures). Only the KV bytes take another path: the decode rank registers a
receive buffer per room and prefill rank with its engine and names it in its init message
(`mooncake_session`, `mooncake_ptr`, `mooncake_len`); the prefill rank registers the gathered KV,
writes it into that buffer with `transfer_sync_write` (one-sided), then sends its kv message
without a payload. The decode rank reads the KV from its buffer, as it reads a ZMQ payload.

Mooncake comes from PyPI: `mooncake-transfer-engine-non-cuda` (the CUDA builds need libcuda), and
its engine needs libibverbs (Debian/Ubuntu: libibverbs1) even for TCP (docs/disaggregation.md).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda, and libibverbs1 (apt-get install libibverbs1); "
    "see docs/disaggregation.md"
)
# A buffer a transfer no longer needs is unregistered and freed this much later: a prefill rank
# still writing into it (a failure raced the transfer) then writes into registered memory.
RETIRE_AFTER_S = 10.0


def load_transfer_engine() -> Any:  # noqa: ANN401 - mooncake.engine.TransferEngine
    """The TransferEngine class, or a RuntimeError saying how to install it."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise RuntimeError(
            f"--disaggregation-transfer-backend mooncake: Mooncake cannot be loaded ({exc}); {INSTALL_HINT}"
        ) from exc
    return TransferEngine


class MooncakeEngine:
    """One TransferEngine per rank (P2P handshake: no metadata server), on `hostname`."""

    def __init__(self, hostname: str) -> None:
        self.engine = load_transfer_engine()()
        if self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's TransferEngine did not start on {hostname} (tcp transport)")
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._retired: list[tuple[float, torch.Tensor]] = []

    # ------------------------------------------------------------------ decode side
    def receive_buffer(self, num_bytes: int) -> torch.Tensor:
        """A registered buffer a peer may write `num_bytes` into."""
        buf = torch.empty(num_bytes, dtype=torch.uint8)
        if self.engine.register_memory(buf.data_ptr(), num_bytes) != 0:
            raise RuntimeError(f"Mooncake could not register a {num_bytes}-byte receive buffer")
        return buf

    def retire(self, buf: torch.Tensor) -> None:
        """Unregister and free `buf` once no late write can reach it (RETIRE_AFTER_S)."""
        now = time.monotonic()
        with self._lock:
            self._retired.append((now, buf))
            due = [b for t, b in self._retired if now - t > RETIRE_AFTER_S]
            self._retired = [(t, b) for t, b in self._retired if now - t <= RETIRE_AFTER_S]
        for old in due:
            self.engine.unregister_memory(old.data_ptr())

    # ------------------------------------------------------------------ prefill side
    def write(self, payload: Any, session: str, dst_ptr: int, dst_len: int) -> str | None:  # noqa: ANN401
        """Write `payload` (a buffer: bytes, memoryview, zmq.Frame) into the peer's registered
        buffer; None on success, else why it failed."""
        data = np.frombuffer(payload.buffer if hasattr(payload, "buffer") else payload, dtype=np.uint8)
        if data.nbytes != dst_len:
            return f"the decode rank's buffer holds {dst_len} bytes, the KV is {data.nbytes}"
        src = data.ctypes.data
        if self.engine.register_memory(src, data.nbytes) != 0:
            return "Mooncake could not register the KV to send"
        try:
            ret = self.engine.transfer_sync_write(session, src, dst_ptr, data.nbytes)
        finally:
            self.engine.unregister_memory(src)
        return None if ret >= 0 else f"Mooncake transfer_sync_write to {session} failed ({ret})"


def kv_nbytes(num_layers: int, head_dim: int, heads: tuple[int, int], num_tokens: int, dtype: str) -> int:
    """Bytes of the KV (gather_kv's layout) a prefill rank sends for these heads and tokens."""
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * num_layers * num_tokens * (heads[1] - heads[0]) * head_dim * itemsize
