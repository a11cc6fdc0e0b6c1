"""The HTTP server process: its children, uvicorn, the warm-up request and the health state.

Start-up (launch_server.py starts the children and loads the tokenizer before building it): serve
the app with uvicorn on uvloop, send one warm-up request, then log the readiness line. Shutdown
(SIGTERM or SIGINT) drains first (entrypoints/drain.py): new requests get 503, in-flight ones get
--graceful-shutdown-timeout to finish and are then aborted with a final event; then uvicorn stops,
the TokenizerManager closes its sockets, the children are stopped and the process exits 0. A
child dying on its own turns /health to 503 and the process exits 1 within a few seconds, unless
--restart-on-failure restarts the children (entrypoints/supervisor.py, docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from radixserve.disaggregation.utils import FAKE_BOOTSTRAP_HOST
from radixserve.entrypoints.drain import Drain, DrainingServer, DrainMiddleware
from radixserve.entrypoints.healing import RestartHandler
from radixserve.entrypoints.http_server import ServerState, create_app
from radixserve.entrypoints.subprocesses import SchedulerEntry, StartedChildren, launch_subprocesses
from radixserve.entrypoints.supervisor import RestartBudget, Supervisor
from radixserve.managers.crash_dump import write_crash_dump
from radixserve.managers.decode_tokenizer import decode_spec
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs
from radixserve.utils.process import ChildProcesses, limit_threads

logger = logging.getLogger(__name__)

READY_LINE = "The server is fired up and ready to roll!"
# uvicorn's own graceful shutdown, which cuts what is still open: after a drain nothing is; after a
# second signal or a child's death nobody should wait long.
UVICORN_SHUTDOWN_S = 5
DEATH_GRACE_S = 1.0  # /health reports 503 this long before the server begins to exit
DEATH_HARD_EXIT_S = 3.0  # then exit no matter what in-flight work remains (all within 5 s)
WARMUP_TIMEOUT_S = 600.0


class ServerRuntime:
    """Owns the children, the uvicorn server and the health state of one server process."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        started: StartedChildren,
        tokenizer: Any,
        scheduler_entry: SchedulerEntry | None,
    ) -> None:
        """`started`: the children, already ready (launch_server starts them before this module is
        imported); `tokenizer`: the loaded HF tokenizer; `scheduler_entry` restarts them alike."""
        self.server_args = server_args
        self.port_args = port_args
        self.first_start_s = started.start_s  # Retry-After until a restart is measured
        self.supervisor = Supervisor(
            started.children,
            lambda into: launch_subprocesses(
                server_args, port_args, scheduler_entry, into, lambda: decode_spec(tokenizer)
            ),
            RestartBudget.from_args(server_args),
        )
        limit_threads()  # after spawning, so the scheduler does not inherit the limits
        tm = TokenizerManager(server_args, port_args, started.info, tokenizer)
        self.state = ServerState(tm=tm)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain = Drain(server_args.graceful_shutdown_timeout, self._abort_in_flight, self._request_exit)
        app = create_app(self.state, lifespan=self._lifespan)
        app.add_middleware(DrainMiddleware, drain=self.drain)  # outermost: it counts every request
        config = uvicorn.Config(
            app,
            host=server_args.host,
            port=server_args.port,
            loop="uvloop",
            log_level=server_args.log_level,
            timeout_graceful_shutdown=UVICORN_SHUTDOWN_S,
            timeout_keep_alive=5,
        )
        self.server = DrainingServer(config, self.drain)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.loop = asyncio.get_running_loop()
        await self.state.tm.start()
        self.supervisor.start(
            RestartHandler(self.state.tm, self.loop, self._on_child_death, self._set_restarting)
        )
        threading.Thread(target=self._warmup, name="warmup", daemon=True).start()
        self.drain.loop = self.loop  # signals drain from now on
        yield
        await self.state.tm.close()

    @property
    def children(self) -> ChildProcesses:
        return self.supervisor.children

    def _set_restarting(self, restarting: bool) -> None:
        if restarting:
            self.state.retry_after_s = self.supervisor.retry_after_s(self.first_start_s)
        self.state.restarting = restarting

    def _on_child_death(self, reason: str) -> None:
        """Supervisor thread, no restart allowed: report unhealthy, fail in-flight requests, then
        exit non-zero."""
        self.state.dead = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(write_crash_dump, self.state.tm, reason)  # before fail_all
            self.loop.call_soon_threadsafe(self.state.tm.fail_all, reason, 503)
        threading.Timer(DEATH_GRACE_S, self._request_exit).start()
        threading.Timer(DEATH_HARD_EXIT_S, self._hard_exit).start()

    def _request_exit(self) -> None:
        self.server.should_exit = True

    def _abort_in_flight(self, message: str) -> None:
        """The drain's deadline: finish every request now with a 503 abort (streams get it as their
        last event) and have the scheduler drop them; a request still tokenizing is refused."""
        self.state.tm.fail_all(message, 503)
        self.state.tm.abort_request(abort_all=True)

    def _hard_exit(self) -> None:
        logger.error("Exiting after a child process died")
        self.children.terminate(timeout=0.2)  # they also get SIGKILL when we exit (PDEATHSIG)
        self.port_args.cleanup()
        os._exit(1)

    def _warmup(self) -> None:
        """Send one real request through HTTP, then declare the server ready."""
        args = self.server_args
        url = f"http://{args.host}:{args.port}"
        headers = {"Content-Type": "application/json"}
        if args.api_key:
            headers["Authorization"] = f"Bearer {args.api_key}"
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        body: dict[str, object] = {
            "text": "The capital city of France is",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
        route = "/generate"
        if not self.state.tm.is_generation:  # embedding/classification models cannot generate
            body, route = {"text": "The capital city of France is"}, "/encode"
        if args.disaggregation_mode != "null":
            # Half of a PD pair warms up alone: the fake bootstrap host moves no KV (as SGLang).
            body.update(bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=0)
        try:
            req = urllib.request.Request(f"{url}{route}", json.dumps(body).encode(), headers, method="POST")
            with urllib.request.urlopen(req, timeout=WARMUP_TIMEOUT_S) as resp:
                resp.read()
        except Exception as exc:
            logger.error("Warm-up request failed: %r", exc)
            self.state.dead = True
            self._request_exit()
            return
        self.state.ready = True
        logger.info(READY_LINE)

    def run(self) -> int:
        """Serve until shut down; return the process exit code."""
        # uvicorn re-raises the signal it caught after its graceful shutdown; a recording
        # handler keeps that from killing us before the children are stopped.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        try:
            self.server.run()
        finally:
            # After a child died, the others are not worth waiting for (they may be blocked on it).
            self.supervisor.stop(timeout=0.5 if self.state.dead else 3.0)
            self.port_args.cleanup()
        if self.state.dead:
            # Children stopped, sockets removed, logs flushed: skip the interpreter's teardown
            # (seconds on a loaded machine, and the hard-exit timer would wait for it anyway).
            logging.shutdown()
            os._exit(1)
        return 0
