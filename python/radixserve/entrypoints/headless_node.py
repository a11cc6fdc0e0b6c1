"""A node other than 0 of a multi-node layout (`--nnodes N --node-rank R`, R > 0): it runs its
scheduler ranks and a small health endpoint on --host:--port, nothing else. Requests go to node 0,
whose rank 0 hands them to every rank over torch.distributed.

/health and /health_generate answer 200 while every local rank runs and 503 once one died (the
node then exits non-zero within a few seconds, as node 0 does).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from radixserve.entrypoints.subprocesses import STARTUP_TIMEOUT_S, start_rank_processes
from radixserve.server_args import ServerArgs
from radixserve.utils.process import ChildProcesses

logger = logging.getLogger(__name__)

DEATH_EXIT_S = 1.0  # /health reports 503 this long before the node exits


class HeadlessNode:
    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        self.dead = False
        self.children = ChildProcesses()
        try:
            start_rank_processes(self.children, server_args, None)
            self.children.wait_ready(STARTUP_TIMEOUT_S)
        except BaseException:
            self.children.terminate()
            raise
        layout = server_args.layout()
        logger.info(
            "Node %d of %d ready: ranks %s of %d; health at http://%s:%d/health",
            server_args.node_rank,
            server_args.nnodes,
            list(layout.local_ranks()),
            layout.world_size,
            server_args.host,
            server_args.port,
        )
        config = uvicorn.Config(
            self._app(), host=server_args.host, port=server_args.port, log_level=server_args.log_level
        )
        self.server = uvicorn.Server(config)

    def _app(self) -> FastAPI:
        app = FastAPI(title="radixserve headless node")

        async def health() -> Response:
            if self.dead:
                return JSONResponse({"error": "A scheduler rank on this node died."}, status_code=503)
            return Response(status_code=200)

        app.add_api_route("/health", health, methods=["GET"])
        app.add_api_route("/health_generate", health, methods=["GET"])
        return app

    def _on_child_death(self, name: str, exitcode: int | None) -> None:
        logger.error("%s died (exit code %s): this node exits", name, exitcode)
        self.dead = True
        threading.Timer(DEATH_EXIT_S, self._exit).start()

    def _exit(self) -> None:
        self.children.terminate(timeout=0.5)
        os._exit(1)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        self.children.start_watchdog(self._on_child_death)
        try:
            self.server.run()
        finally:
            self.children.terminate()
        return 1 if self.dead else 0
