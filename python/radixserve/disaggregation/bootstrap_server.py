"""The prefill server's bootstrap server: where decode servers find its KV senders.

SGLang's routes (docs/disaggregation.md):

- PUT /route   a prefill rank registers: {"role": "Prefill", "rank_ip", "rank_port", "engine_rank",
               "tp_size", "dp_size", "page_size", "kv_cache_dtype"}, and here also the model's KV
               shape ("num_layers", "num_kv_heads", "head_dim") and the rank's KV heads
               ("kv_head_start", "kv_head_stop").
- GET /route?engine_rank=-1&target_dp_group=-1   the server's layout (tp_size, dp_size, page_size,
               kv_cache_dtype, the KV shape): the decode side checks it matches before allocating.
- GET /route?engine_rank=R&target_dp_group=G     rank R's {"rank_ip", "rank_port"} (and its KV heads).
- GET /health  200 "OK".

A plain threaded HTTP server: a few requests per new peer, no event loop to share.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger(__name__)

REQUIRED_PUT_FIELDS = ("role", "rank_ip", "rank_port", "engine_rank", "tp_size", "dp_size", "page_size")
# Optional: the model's KV shape (server-wide) and the rank's KV heads (per rank), as integers.
SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim")
HEAD_FIELDS = ("kv_head_start", "kv_head_stop")


class BootstrapTable:
    """What the prefill ranks registered (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.info: dict[str, Any] | None = None  # tp_size, dp_size, page_size, kv_cache_dtype
        self.ranks: dict[tuple[int, int], dict[str, Any]] = {}  # (dp group, engine rank) -> address

    def register(self, data: dict[str, Any]) -> str | None:
        """Store a rank; an error message for a malformed registration."""
        missing = [k for k in REQUIRED_PUT_FIELDS if k not in data]
        if missing:
            return f"missing fields: {missing}"
        if data["role"] != "Prefill":
            return f"only Prefill ranks register here, got role {data['role']!r}"
        try:
            rank, port = int(data["engine_rank"]), int(data["rank_port"])
            tp_size, dp_size, page_size = int(data["tp_size"]), int(data["dp_size"]), int(data["page_size"])
            shape = {k: int(data[k]) for k in SHAPE_FIELDS if k in data}
            heads = {k: int(data[k]) for k in HEAD_FIELDS if k in data}
        except (TypeError, ValueError) as exc:
            return f"bad field: {exc}"
        with self._lock:
            self.info = {
                "tp_size": tp_size,
                "dp_size": dp_size,
                "page_size": page_size,
                "kv_cache_dtype": data.get("kv_cache_dtype"),
                **shape,
            }
            group = rank // max(tp_size // max(dp_size, 1), 1)
            self.ranks[(group, rank)] = {"rank_ip": str(data["rank_ip"]), "rank_port": port, **heads}
        logger.info("Registered prefill rank %d at %s:%d", rank, data["rank_ip"], port)
        return None

    def lookup(self, engine_rank: int, dp_group: int) -> tuple[int, dict[str, Any] | str]:
        with self._lock:
            if self.info is None:
                return 503, "no prefill rank registered yet"
            if engine_rank == -1 and dp_group == -1:
                return 200, dict(self.info)
            entry = self.ranks.get((dp_group, engine_rank))
        if entry is None:
            return 404, f"no prefill rank {engine_rank} in dp group {dp_group}"
        return 200, dict(entry)


class _Handler(BaseHTTPRequestHandler):
    table: BootstrapTable  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        logger.debug("bootstrap: " + format, *args)

    def _reply(self, status: int, body: dict[str, Any] | str) -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlparse(self.path)
        if url.path == "/health":
            self._reply(200, "OK")
            return
        if url.path != "/route":
            self._reply(404, "not found")
            return
        query = parse_qs(url.query)
        try:
            engine_rank = int(query["engine_rank"][0])
            dp_group = int(query.get("target_dp_group", ["0"])[0])
        except (KeyError, ValueError):
            self._reply(400, "Missing or bad engine_rank / target_dp_group")
            return
        self._reply(*self.table.lookup(engine_rank, dp_group))

    def do_PUT(self) -> None:  # noqa: N802
        if urlparse(self.path).path != "/route":
            self._reply(404, "not found")
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            data = json.loads(self.rfile.read(length) or b"{}")
        except (ValueError, json.JSONDecodeError):
            self._reply(400, "the body must be JSON")
            return
        error = self.table.register(data) if isinstance(data, dict) else "the body must be a JSON object"
        self._reply(400, error) if error else self._reply(200, "OK")

    def do_POST(self) -> None:  # noqa: N802
        self._reply(405, "Method not allowed")


class BootstrapServer:
    """Serves a BootstrapTable on host:port from a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        self.table = BootstrapTable()
        handler = type("BootstrapHandler", (_Handler,), {"table": self.table})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="pd-bootstrap", daemon=True)
        self.thread.start()
        logger.info("Bootstrap server listening on %s:%d", host, self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
