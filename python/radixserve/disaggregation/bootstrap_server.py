"""The prefill server's bootstrap server: where decode servers find its KV senders.

SGLang's routes (docs/disaggregation.md):

- PUT /route   a prefill rank registers: {"role": "Prefill", "rank_ip", "rank_port", "engine_rank"
               (its TP rank), "tp_size", "dp_size", "page_size", "kv_cache_dtype"}, with --dp-size > 1
               also "system_dp_size" and "system_dp_rank" (its replica) and "load_balance_method";
               here also the model's KV shape ("num_layers", "num_kv_heads", "head_dim") and the
               rank's KV heads ("kv_head_start", "kv_head_stop").
- GET /route?engine_rank=-1&target_dp_group=-1   the server's layout (tp_size, dp_size, page_size,
               kv_cache_dtype, follow_bootstrap_room, the KV shape) once every rank of every replica
               registered (503 before): the decode side checks it matches before allocating.
- GET /route?engine_rank=R&target_dp_group=G     replica G's TP rank R: {"rank_ip", "rank_port"} (and
               its KV heads). SGLang's newer names are read too: prefill_dp_rank (G), target_tp_rank
               (R), prefill_cp_rank and target_pp_rank (0; -1 everywhere asks for the layout).
- POST /register_dp_rank {"bootstrap_room", "dp_rank"}   a replica says it holds a room (when the
               room alone does not tell: a load_balance_method other than follow_bootstrap_room).
- POST /query_dp_ranks {"bootstrap_rooms": [...]}   {"<room>": dp_rank} for the rooms registered.
- GET /health  200 "OK".

A plain threaded HTTP server: a few requests per new peer, no event loop to share.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger(__name__)

REQUIRED_PUT_FIELDS = ("role", "rank_ip", "rank_port", "engine_rank", "tp_size", "dp_size", "page_size")
# Optional: the model's KV shape (server-wide) and the rank's KV heads (per rank), as integers.
SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim")
HEAD_FIELDS = ("kv_head_start", "kv_head_stop")
# How long a room's registered replica is kept when `entry_ttl_s` is not given.
DEFAULT_ENTRY_TTL_S = 600.0


class BootstrapTable:
    """What the prefill ranks registered, and which replica holds which room (thread-safe)."""

    def __init__(self, entry_ttl_s: float = DEFAULT_ENTRY_TTL_S) -> None:
        self._lock = threading.Lock()
        self.info: dict[str, Any] | None = None  # tp_size, dp_size, page_size, kv_cache_dtype, ...
        self.ranks: dict[tuple[int, int], dict[str, Any]] = {}  # (dp group, TP rank) -> address
        self.room_to_dp_rank: dict[int, tuple[int, float]] = {}  # room -> (dp rank, registered at)
        self.entry_ttl_s = entry_ttl_s

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
            group, rank = _dp_group(data, rank, tp_size, dp_size)
            dp_size = max(dp_size, int(data.get("system_dp_size", 1)))
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            return f"bad field: {exc}"
        method = str(data.get("load_balance_method", "follow_bootstrap_room"))
        with self._lock:
            self.info = {
                "tp_size": tp_size,
                "dp_size": dp_size,
                "page_size": page_size,
                "kv_cache_dtype": data.get("kv_cache_dtype"),
                "follow_bootstrap_room": method == "follow_bootstrap_room",
                **shape,
            }
            self.ranks[(group, rank)] = {"rank_ip": str(data["rank_ip"]), "rank_port": port, **heads}
        logger.info("Registered prefill replica %d rank %d at %s:%d", group, rank, data["rank_ip"], port)
        return None

    def _missing(self) -> int:
        """Ranks of the announced layout that have not registered yet (call under the lock)."""
        assert self.info is not None
        return self.info["dp_size"] * self.info["tp_size"] - len(self.ranks)

    def lookup(self, engine_rank: int, dp_group: int) -> tuple[int, dict[str, Any] | str]:
        with self._lock:
            if self.info is None:
                return 503, "no prefill rank registered yet"
            if self._missing() > 0:
                return 503, f"the prefill server is not fully registered yet ({len(self.ranks)} ranks)"
            if engine_rank == -1 and dp_group == -1:
                return 200, dict(self.info)
            entry = self.ranks.get((dp_group, engine_rank))
        if entry is None:
            return 404, f"no prefill rank {engine_rank} in dp group {dp_group}"
        return 200, dict(entry)

    def register_room(self, room: int, dp_rank: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.room_to_dp_rank[room] = (dp_rank, now)
            if len(self.room_to_dp_rank) % 256 == 0:  # forget rooms nobody asked for in time
                old = [r for r, (_, t) in self.room_to_dp_rank.items() if now - t > self.entry_ttl_s]
                for r in old:
                    del self.room_to_dp_rank[r]

    def query_rooms(self, rooms: list[int]) -> dict[str, int]:
        with self._lock:
            return {str(r): self.room_to_dp_rank[r][0] for r in rooms if r in self.room_to_dp_rank}


def _dp_group(data: dict[str, Any], rank: int, tp_size: int, dp_size: int) -> tuple[int, int]:
    """(replica, TP rank in it): system_dp_rank names the replica (SGLang's --dp-size replicas);
    without it, SGLang's older numbering of engine ranks across DP groups."""
    if "system_dp_rank" in data:
        return int(data["system_dp_rank"]), rank
    per_group = max(tp_size // max(dp_size, 1), 1)
    return rank // per_group, rank % per_group


def _route_args(query: dict[str, list[str]]) -> tuple[int, int]:
    """(engine_rank, dp group) from SGLang's older or newer GET /route arguments."""
    if "engine_rank" in query:
        return int(query["engine_rank"][0]), int(query.get("target_dp_group", ["0"])[0])
    dp, tp = int(query["prefill_dp_rank"][0]), int(query["target_tp_rank"][0])
    allowed = (0, -1) if dp == -1 else (0,)  # all -1: the layout
    if any(int(query.get(k, ["0"])[0]) not in allowed for k in ("prefill_cp_rank", "target_pp_rank")):
        raise ValueError("only prefill_cp_rank 0 and target_pp_rank 0 exist here")
    return tp, dp


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
        try:
            engine_rank, dp_group = _route_args(parse_qs(url.query))
        except (KeyError, ValueError):
            self._reply(400, "Missing or bad engine_rank / target_dp_group")
            return
        self._reply(*self.table.lookup(engine_rank, dp_group))

    def _json_body(self) -> Any:  # noqa: ANN401 - whatever JSON the client sent
        length = int(self.headers.get("Content-Length", "0"))
        return json.loads(self.rfile.read(length) or b"{}")

    def do_PUT(self) -> None:  # noqa: N802
        if urlparse(self.path).path != "/route":
            self._reply(404, "not found")
            return
        try:
            data = self._json_body()
        except (ValueError, json.JSONDecodeError):
            self._reply(400, "the body must be JSON")
            return
        error = self.table.register(data) if isinstance(data, dict) else "the body must be a JSON object"
        self._reply(400, error) if error else self._reply(200, "OK")

    def do_POST(self) -> None:  # noqa: N802
        path = urlparse(self.path).path
        if path not in ("/register_dp_rank", "/query_dp_ranks"):
            self._reply(405, "Method not allowed")
            return
        try:
            data = self._json_body()
            if path == "/register_dp_rank":
                self.table.register_room(int(data["bootstrap_room"]), int(data["dp_rank"]))
                self._reply(200, "OK")
            else:
                self._reply(200, self.table.query_rooms([int(r) for r in data["bootstrap_rooms"]]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._reply(400, f"bad request: {exc!r}")


class BootstrapServer:
    """Serves a BootstrapTable on host:port from a daemon thread."""

    def __init__(self, host: str, port: int, entry_ttl_s: float = DEFAULT_ENTRY_TTL_S) -> None:
        self.table = BootstrapTable(entry_ttl_s)
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


class RoomRegistrar:
    """A prefill replica's POST /register_dp_rank calls, from a thread of their own (the scheduler
    never waits on HTTP): the rooms whose replica a decode server cannot derive from the room."""

    def __init__(self, bootstrap_url: str, dp_rank: int) -> None:
        self.url = f"{bootstrap_url}/register_dp_rank"
        self.dp_rank = dp_rank
        self.queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="pd-room-registrar", daemon=True)
        self.thread.start()

    def add(self, room: int) -> None:
        self.queue.put(room)

    def _run(self) -> None:
        while (room := self.queue.get()) is not None:
            body = json.dumps({"bootstrap_room": room, "dp_rank": self.dp_rank}).encode()
            request = urllib.request.Request(self.url, data=body, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=5) as resp:
                    resp.read()
            except OSError as exc:  # the decode side then waits for it until its timeout
                logger.error("Could not register room %d's replica %d: %s", room, self.dp_rank, exc)

    def close(self) -> None:
        self.queue.put(None)
