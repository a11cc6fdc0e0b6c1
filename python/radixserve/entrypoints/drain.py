"""Graceful shutdown: the first SIGTERM (or SIGINT) drains the server before it exits.

1. Every new HTTP request, /health included, is refused with 503 (`Connection: close`) so load
   balancers move away. The listening socket stays open meanwhile: a client gets an answer that
   says why rather than a refused connection.
2. Requests already in flight run on until they finish or --graceful-shutdown-timeout passes.
3. At the deadline `on_deadline` finishes every unfinished request with an abort (HTTP 503): a
   stream's last event carries finish_reason "abort" and the message, then [DONE]; a call waiting
   for its whole answer gets 503.
4. Once those answers are written (at most FLUSH_S more), `on_done` tells uvicorn to exit; only
   then are the sockets and the child processes closed, so nothing still reads from them.

A second signal skips what is left of the drain (uvicorn's own shutdown, which cuts open streams).
docs/deploy.md ("Stopping a server") states the behaviour for operators.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.entrypoints.error_dialects import ErrorDialectMiddleware
from radixserve.entrypoints.http_guards import error_response

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "The server is shutting down."
FLUSH_S = 5.0  # after the deadline: time for the aborted requests' last answers to be written
POLL_S = 0.05
OPEN_PATHS = ("/metrics",)  # still answered while draining: scrapes see the drain happen


class Drain:
    """The drain's state: whether it runs, and how many HTTP requests are in progress."""

    def __init__(
        self, timeout_s: float, on_deadline: Callable[[str], None], on_done: Callable[[], None]
    ) -> None:
        self.timeout_s = timeout_s
        self.on_deadline = on_deadline
        self.on_done = on_done
        self.draining = False
        self.num_active = 0  # HTTP requests whose response is not yet complete
        self.loop: asyncio.AbstractEventLoop | None = None  # set once the app serves
        self._task: asyncio.Task[None] | None = None

    def begin(self, reason: str) -> bool:
        """Start draining (from a signal handler); False when there is nothing to drain into (the
        app is not serving yet, or a drain already runs), so the caller stops at once instead."""
        if self.loop is None or self.draining:
            return False
        self.draining = True
        self.loop.call_soon_threadsafe(self._start, reason)
        return True

    def _start(self, reason: str) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(reason))

    async def _run(self, reason: str) -> None:
        logger.warning(
            "%s: draining %d request(s) for up to %.0f s (--graceful-shutdown-timeout); new requests get 503",
            reason,
            self.num_active,
            self.timeout_s,
        )
        if not await self._wait_idle(self.timeout_s):
            logger.warning("Drain deadline passed: aborting %d request(s)", self.num_active)
            self.on_deadline(f"{SHUTTING_DOWN} The request was aborted at the drain deadline.")
            if not await self._wait_idle(FLUSH_S):
                logger.warning(
                    "%d response(s) still open %.0f s after the deadline", self.num_active, FLUSH_S
                )
        logger.info("Drain finished; shutting down")
        self.on_done()

    async def _wait_idle(self, timeout_s: float) -> bool:
        """Polling is enough: it runs only while draining, and a drain lasts seconds."""
        deadline = time.monotonic() + timeout_s
        while self.num_active > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True


class DrainMiddleware:
    """Pure ASGI (streams pass through untouched): counts requests, refuses new ones while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] not in OPEN_PATHS:
            refusal = error_response(503, SHUTTING_DOWN)
            refusal.headers["Connection"] = "close"  # the next request must go to another server
            await ErrorDialectMiddleware(refusal)(scope, receive, send)  # Anthropic's, Ollama's shape
            return
        self.drain.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.num_active -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT starts the drain instead of closing the
    listening socket and cutting streams after its graceful-shutdown timeout."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit or not self.drain.begin(signal.Signals(sig).name):
            super().handle_exit(sig, frame)  # a second signal, or none drained: stop now
