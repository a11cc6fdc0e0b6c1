"""SchedulerInputBlocker (seed 002 §7.1, INVENTORY §35): flow control in front of the dispatcher.

BLOCK holds every request that arrives; UNBLOCK moves to a global barrier and the held requests are
released only once every rank has unblocked. States: UNBLOCKED -> BLOCKED (BLOCK) ->
GLOBAL_UNBLOCK_BARRIER (UNBLOCK) -> UNBLOCKED (the barrier arrived; pending requests released in
arrival order).

Here every rank runs the blocker on the same received messages (rank 0 broadcasts what it reads,
BLOCK/UNBLOCK included), so all ranks change state in the same step, and the barrier's poll — an
all-reduce over the world, made only while some rank waits at the barrier, which then is every
rank — arrives in the same step on all of them. A rank that receives nothing of its own (the seed's
`noop`) passes None and only takes part in the barrier.
"""

from __future__ import annotations

import logging
from enum import Enum, auto

from radixserve.distributed.rank_runtime import LocalSync, RankSync
from radixserve.managers.io_struct import BlockReqInput, BlockReqType

logger = logging.getLogger(__name__)


class _State(Enum):
    UNBLOCKED = auto()
    BLOCKED = auto()
    GLOBAL_UNBLOCK_BARRIER = auto()


class PollBasedBarrier:
    """A barrier polled once per step instead of waited on: `poll_global_arrived()` is True (once)
    when this rank arrived and every other rank arrived too (noop ranks count as arrived)."""

    def __init__(self, noop: bool = False, sync: RankSync | None = None) -> None:
        self._noop = noop
        self._sync: RankSync = sync or LocalSync()
        self._local_arrived = False

    def local_arrive(self) -> None:
        self._local_arrived = True

    def poll_global_arrived(self) -> bool:
        (everyone,) = self._sync.all_agree([self._noop or self._local_arrived])
        arrived = self._local_arrived and everyone
        if arrived:
            self._local_arrived = False
        return arrived


class SchedulerInputBlocker:
    def __init__(self, noop: bool = False, sync: RankSync | None = None) -> None:
        self._state = _State.UNBLOCKED
        self._pending: list[object] = []
        self._noop = noop
        self._barrier = PollBasedBarrier(noop, sync)

    @property
    def is_blocking(self) -> bool:
        return self._state != _State.UNBLOCKED

    @property
    def at_barrier(self) -> bool:
        """Unblocked here, waiting for the other ranks: polled every step until they all are."""
        return self._state == _State.GLOBAL_UNBLOCK_BARRIER

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def handle(self, recv_reqs: list[object] | None) -> list[object] | None:
        """The requests to dispatch now (None on a noop rank)."""
        assert (recv_reqs is None) == self._noop, "noop ranks pass None, the others a list"
        out: list[object] = []
        for req in recv_reqs or ():
            out += self._handle_one(req)
        # The barrier is polled only while this rank waits at it; every rank reaches that state in
        # the same step (module docstring), so the poll's all-reduce is matched on every rank.
        if self._state == _State.GLOBAL_UNBLOCK_BARRIER and self._barrier.poll_global_arrived():
            out += self._release()
        return None if self._noop else out

    def _handle_one(self, req: object) -> list[object]:
        if isinstance(req, BlockReqInput):
            if req.type == BlockReqType.BLOCK:
                self._block()
            elif req.type == BlockReqType.UNBLOCK:
                self._unblock()
            else:  # pragma: no cover - the enum has two members
                raise ValueError(f"unknown BlockReqInput type {req.type!r}")
            return []
        if self._state == _State.UNBLOCKED:
            return [req]
        self._pending.append(req)
        return []

    def _block(self) -> None:
        if self._state != _State.UNBLOCKED:
            logger.warning("BLOCK while %s: ignored", self._state.name)
            return
        logger.info("Input blocked: requests are held until UNBLOCK")
        self._state = _State.BLOCKED

    def _unblock(self) -> None:
        if self._state != _State.BLOCKED:
            logger.warning("UNBLOCK while %s: ignored", self._state.name)
            return
        self._state = _State.GLOBAL_UNBLOCK_BARRIER
        self._barrier.local_arrive()

    def _release(self) -> list[object]:
        released, self._pending = self._pending, []
        self._state = _State.UNBLOCKED
        logger.info("Input unblocked on every rank: %d held request(s) released", len(released))
        return released
