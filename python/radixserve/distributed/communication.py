"""The collectives the engine uses, over torch.distributed groups.

Python objects (the scheduler's received requests, results sent between pipeline stages) travel
pickled in a byte tensor. The first message has a fixed size that holds the length and, for the
small messages of a typical step (often an empty list), the whole payload, so one step costs one
collective; a larger payload follows in a second message.

`TensorParallelComm` is what model layers call: all-reduce and all-gather over the rank's TP
group, through the same-host shared-memory communicator on CPU when there is one (gloo's TCP
path costs ~0.2-2 ms per call on the 2-core machines measured, against microseconds for shared
memory: docs/benchmarks.md), else through the device group (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# One step's control message fits here in the common case (an empty list pickles to ~5 bytes).
HEADER_BYTES = 4096
_LEN_BYTES = 8


def _pack(obj: Any) -> tuple[torch.Tensor, torch.Tensor | None]:  # noqa: ANN401 - any picklable object
    """(fixed-size header holding the length and as much payload as fits, the rest or None)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    header[:_LEN_BYTES] = torch.frombuffer(
        bytearray(len(data).to_bytes(_LEN_BYTES, "little")), dtype=torch.uint8
    )
    inline = min(len(data), HEADER_BYTES - _LEN_BYTES)
    if inline:
        header[_LEN_BYTES : _LEN_BYTES + inline] = torch.frombuffer(
            bytearray(data[:inline]), dtype=torch.uint8
        )
    rest = None
    if len(data) > inline:
        rest = torch.frombuffer(bytearray(data[inline:]), dtype=torch.uint8)
    return header, rest


def _payload_len(header: torch.Tensor) -> int:
    return int.from_bytes(header[:_LEN_BYTES].numpy().tobytes(), "little")


def _unpack(header: torch.Tensor, rest: torch.Tensor | None) -> Any:  # noqa: ANN401
    total = _payload_len(header)
    inline = min(total, HEADER_BYTES - _LEN_BYTES)
    data = header[_LEN_BYTES : _LEN_BYTES + inline].numpy().tobytes()
    if rest is not None:
        data += rest.numpy().tobytes()
    return pickle.loads(data)


def broadcast_pyobj(obj: Any, src: int, group: dist.ProcessGroup, is_src: bool) -> Any:  # noqa: ANN401
    """`obj` from global rank `src` to every rank of `group` (the others pass anything)."""
    if is_src:
        header, rest = _pack(obj)
    else:
        header, rest = torch.empty(HEADER_BYTES, dtype=torch.uint8), None
    dist.broadcast(header, src=src, group=group)
    extra = _payload_len(header) - (HEADER_BYTES - _LEN_BYTES)
    if extra > 0:
        if rest is None:
            rest = torch.empty(extra, dtype=torch.uint8)
        dist.broadcast(rest, src=src, group=group)
    return obj if is_src else _unpack(header, rest)


class PendingSends:
    """Asynchronous sends whose buffers must stay alive until they complete."""

    def __init__(self) -> None:
        self._inflight: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []

    def add(self, work: dist.Work, *buffers: torch.Tensor) -> None:
        self._inflight.append((work, buffers))
        self._inflight = [(w, b) for w, b in self._inflight if not w.is_completed()]

    def wait_all(self) -> None:
        for work, _ in self._inflight:
            work.wait()
        self._inflight.clear()


def send_pyobj(obj: Any, dst: int, group: dist.ProcessGroup, pending: PendingSends) -> None:  # noqa: ANN401
    """Send `obj` to global rank `dst` without waiting for the receiver."""
    header, rest = _pack(obj)
    pending.add(dist.isend(header, dst=dst, group=group), header)
    if rest is not None:
        pending.add(dist.isend(rest, dst=dst, group=group), rest)


def recv_pyobj(src: int, group: dist.ProcessGroup) -> Any:  # noqa: ANN401
    header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    dist.recv(header, src=src, group=group)
    extra = _payload_len(header) - (HEADER_BYTES - _LEN_BYTES)
    rest = None
    if extra > 0:
        rest = torch.empty(extra, dtype=torch.uint8)
        dist.recv(rest, src=src, group=group)
    return _unpack(header, rest)


def all_reduce_ints(values: list[int], op: dist.ReduceOp, group: dist.ProcessGroup) -> list[int]:
    """Element-wise MIN / MAX / SUM of equal-length int lists over `group`."""
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group)
    return [int(v) for v in t.tolist()]


# ---------------------------------------------------------------------------------------------
# Tensor parallelism as the model sees it
# ---------------------------------------------------------------------------------------------


class _FastComm(Protocol):
    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...


class TensorParallelComm:
    """The TP group's rank, size and the two collectives sharded layers need."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: dist.ProcessGroup | None = None,
        fast: _FastComm | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.group = group
        self.fast = fast  # same-host shared memory (CPU); None: the device group

    @classmethod
    def single(cls) -> TensorParallelComm:
        return cls()

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; every rank ends with bit-identical values."""
        if self.size == 1:
            return x
        if self.fast is not None and x.dtype == torch.float32 and x.is_contiguous():
            return self.fast.all_reduce_(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's part at columns [r*n, (r+1)*n)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.fast is not None and x.dtype == torch.float32:
            return self.fast.all_gather(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)
