"""A zmq PULL socket read from the event loop's own reader callback, not through zmq.asyncio.

Why: the tokenizer manager receives one message per scheduler step per stream (at one stream,
one per token), and pyzmq's asyncio recv spends ~85 us of CPU per message on its futures, poller
registration and flag enums, against ~35-45 us for a plain non-blocking recv drained from
loop.add_reader (benchmark/bench_socket_reader.py). On a 2-core machine that CPU is taken from
the forward's threads. The messages and their order are the same.

zmq's FD is edge-triggered: it signals when the socket's state may have changed, so a callback
drains until zmq.Again; when it stops early (MAX_PER_CALL, so a burst cannot hold the loop) it
schedules itself again, since no new edge would come for messages already queued.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)

MAX_PER_CALL = 64  # messages handled per callback before the loop gets a turn


class SocketReader:
    def __init__(self, sock: zmq.Socket, handle: Callable[[object], None]) -> None:
        self.sock = sock
        self.handle = handle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read from now on in `loop`; messages queued before start are read at its next turn."""
        self._loop = loop
        self._fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self.drain)
        loop.call_soon(self.drain)

    def stop(self) -> None:
        """Stop reading (before the socket closes); idempotent."""
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def drain(self) -> None:
        """Handle every queued message, up to MAX_PER_CALL of them; a handler's error is logged and
        the next message is read (the receive loop must not die with one bad message)."""
        if self._loop is None:
            return
        for _ in range(MAX_PER_CALL):
            try:
                msg = self.sock.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            except Exception:
                logger.exception("Failed to receive a message")
                continue
            try:
                self.handle(msg)
            except Exception:
                logger.exception("Failed to handle %s", type(msg).__name__)
            if self._loop is None:  # a handler stopped the reader
                return
        self._loop.call_soon(self.drain)
