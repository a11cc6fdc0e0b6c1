"""What the `tcp` backend's two managers (tcp_prefill.py, tcp_decode.py) share: one I/O thread
owns every socket; the scheduler thread only queues commands on an inproc PUSH that it reads."""

from __future__ import annotations

import itertools
import logging
import threading
from abc import ABC, abstractmethod
from typing import Any

import zmq

from radixserve.disaggregation import wire
from radixserve.disaggregation.backend import RoomHandle
from radixserve.disaggregation.heads import KVLayout
from radixserve.disaggregation.mooncake_engine import MooncakeEngine
from radixserve.disaggregation.utils import TransferStatus

logger = logging.getLogger(__name__)

_ids = itertools.count()


class KVIoThread(ABC):
    """A manager's sockets and the one thread that serves them. A subclass registers its sockets
    on `poller`, then starts `thread`; it handles commands in `_on_command` and the rest of a tick
    (ready sockets, timeouts) in `_on_tick`."""

    def __init__(
        self, side: str, layout: KVLayout, timeout_s: float, mooncake: MooncakeEngine | None
    ) -> None:
        self.side = side  # "prefill" or "decode": names the thread and its log lines
        self.layout = layout
        self.mooncake = mooncake  # the mooncake backend: one-sided writes into the decode side's buffers
        self.page_size = layout.page_size
        self.kv_cache_dtype = layout.kv_cache_dtype
        self.timeout_s = timeout_s
        self.ctx = zmq.Context()
        cmd_addr = f"inproc://pd-{side}-{next(_ids)}"
        self._cmd_in = self.ctx.socket(zmq.PULL)
        self._cmd_in.bind(cmd_addr)
        self._cmd_out = self.ctx.socket(zmq.PUSH)  # used by the scheduler thread only
        self._cmd_out.connect(cmd_addr)
        self._cmd_lock = threading.Lock()
        self._stop = False
        # Built once (the I/O thread's only poller): sockets may come and go with their peers.
        self.poller = zmq.Poller()
        self.poller.register(self._cmd_in, zmq.POLLIN)
        self.thread = threading.Thread(target=self._run, name=f"pd-{side}-io", daemon=True)

    # ------------------------------------------------------------------ scheduler thread
    def command(self, *cmd: Any, payload: memoryview | None = None) -> None:  # noqa: ANN401
        """Queue a command for the I/O thread; a KV payload travels as its own frame, uncopied."""
        with self._cmd_lock:
            self._cmd_out.send_multipart(wire.encode({"cmd": cmd}, payload), copy=payload is None)

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=2)
        self.ctx.destroy(linger=0)

    # ------------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        while not self._stop:
            try:
                ready = dict(self.poller.poll(wire.IO_TICK_MS))
                if self._cmd_in in ready:
                    while self._cmd_in.poll(0):
                        msg, payload = wire.decode(self._cmd_in.recv_multipart(copy=False))
                        self._on_command(msg["cmd"], payload)
                self._on_tick(ready)
            except zmq.ContextTerminated:
                return
            except Exception:  # one bad message must not stop every transfer
                logger.exception("%s KV I/O thread error", self.side.capitalize())

    @abstractmethod
    def _on_command(self, cmd: tuple[Any, ...], payload: Any) -> None:  # noqa: ANN401 - a zmq.Frame
        """Handle one queued command (tcp_prefill.py, tcp_decode.py)."""

    @abstractmethod
    def _on_tick(self, ready: dict[zmq.Socket, int]) -> None:
        """Serve the ready sockets and check timeouts, once per poll."""


class TcpHandle(RoomHandle):
    """A TcpSender's or TcpReceiver's room: only the handle that created it (`owner`) commands
    the I/O thread about it."""

    def __init__(self, manager: KVIoThread, room: int, status: TransferStatus, owner: bool) -> None:
        super().__init__(room, status)
        self.manager = manager
        self.owner = owner

    def close(self) -> None:
        if self.owner:
            self.manager.command("forget", self.room)
