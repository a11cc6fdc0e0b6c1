"""The built-in `tcp` backend, prefill side: one ZMQ ROUTER socket that every decode server's
DEALER connects to, served by one I/O thread.

The scheduler thread only creates senders and queues commands (an inproc PUSH the I/O thread
reads); the I/O thread owns the ROUTER, updates each room's TransferStatus and enforces the
timeouts. A decode server that goes away is noticed by ROUTER_MANDATORY: a send or a liveness ping
to its identity fails with EHOSTUNREACH once ZMQ saw the TCP connection close.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from radixserve.disaggregation import wire
from radixserve.disaggregation.utils import ABORTED_STATUS, KVPoll, TransferStatus

logger = logging.getLogger(__name__)

_ids = itertools.count()


@dataclass
class _Room:
    status: TransferStatus
    claimed: bool = False  # a prefill request owns it (else only a decode side asked for it)
    identity: bytes | None = None  # the decode DEALER that asked for this room
    send_started: float = 0.0
    num_bytes: int = 0
    # A failed room nobody owns is kept this long, so a late init or request still learns why.
    tombstone_until: float = 0.0


@dataclass
class TransferStats:
    num_transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0  # sum over transfers of send start -> acknowledgement
    per_transfer: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds), last 1000

    def as_dict(self) -> dict[str, Any]:
        return {
            "kv_transfers": self.num_transfers,
            "kv_transfer_bytes": self.bytes,
            "kv_transfer_seconds": self.seconds,
            "kv_transfer_gb_per_s": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
        }


class PrefillTcpManager:
    def __init__(
        self, bind_host: str, page_size: int, kv_cache_dtype: str, timeout_s: float, tp_size: int = 1
    ) -> None:
        self.page_size = page_size
        self.kv_cache_dtype = kv_cache_dtype
        self.timeout_s = timeout_s
        self.tp_size = tp_size
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.rank_ip = bind_host
        self.rank_port = self.router.bind_to_random_port(f"tcp://{bind_host}")
        cmd_addr = f"inproc://pd-prefill-{next(_ids)}"
        self._cmd_in = self.ctx.socket(zmq.PULL)
        self._cmd_in.bind(cmd_addr)
        self._cmd_out = self.ctx.socket(zmq.PUSH)  # used by the scheduler thread only
        self._cmd_out.connect(cmd_addr)
        self._cmd_lock = threading.Lock()
        self.rooms: dict[int, _Room] = {}
        self._rooms_lock = threading.Lock()
        self.stats = TransferStats()
        self._stop = False
        self._last_ping = 0.0
        self.thread = threading.Thread(target=self._run, name="pd-prefill-io", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ scheduler thread
    def register(self, bootstrap_host: str, bootstrap_port: int, engine_rank: int = 0) -> None:
        """PUT /route on the bootstrap server (retried briefly: it starts beside us)."""
        body = json.dumps(
            {
                "role": "Prefill",
                "rank_ip": self.rank_ip,
                "rank_port": self.rank_port,
                "engine_rank": engine_rank,
                "tp_size": self.tp_size,
                "dp_size": 1,
                "page_size": self.page_size,
                "kv_cache_dtype": self.kv_cache_dtype,
            }
        ).encode()
        url = f"http://{bootstrap_host}:{bootstrap_port}/route"
        deadline = time.monotonic() + 30
        while True:
            try:
                req = urllib.request.Request(url, data=body, method="PUT")
                with urllib.request.urlopen(req, timeout=5) as resp:
                    resp.read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def create_sender(self, room: int) -> TcpSender:
        with self._rooms_lock:
            state = self.rooms.get(room)
            if state is None or state.claimed:
                if state is not None:  # a room pairs one request: a second one is refused
                    dup = TransferStatus(self.timeout_s)
                    dup.fail(f"bootstrap_room {room} is already in use on this prefill server", 400)
                    return TcpSender(self, room, _Room(dup, claimed=True), owner=False)
                state = _Room(TransferStatus(self.timeout_s))
                self.rooms[room] = state
            state.claimed = True
        return TcpSender(self, room, state, owner=True)

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
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._cmd_in, zmq.POLLIN)
        while not self._stop:
            try:
                ready = dict(poller.poll(wire.IO_TICK_MS))
                if self._cmd_in in ready:
                    while self._cmd_in.poll(0):
                        msg, payload = wire.decode(self._cmd_in.recv_multipart(copy=False))
                        self._on_command(msg["cmd"], payload)
                if self.router in ready:
                    while self.router.poll(0):
                        identity, *frames = self.router.recv_multipart()
                        self._on_message(identity, *wire.decode(frames))
                self._check_rooms()
            except zmq.ContextTerminated:
                return
            except Exception:  # one bad message must not stop every transfer
                logger.exception("Prefill KV I/O thread error")

    def _send(self, identity: bytes, frames: wire.MsgFrames) -> bool:
        try:
            self.router.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:
                return True  # the peer is slow, not gone: ZMQ keeps the message queued
            return False

    def _on_command(self, cmd: tuple[Any, ...], payload: Any = None) -> None:  # noqa: ANN401 - a zmq.Frame
        kind, room = cmd[0], cmd[1]
        state = self.rooms.get(room)
        if kind == "forget":
            with self._rooms_lock:
                if state is not None and state.status.poll() == KVPoll.Failed:
                    state.claimed = False  # a tombstone: the decode side may still ask for it
                else:
                    self.rooms.pop(room, None)
            return
        if state is None:
            return
        if kind == "send":
            meta, kv = cmd[2], payload
            state.send_started, state.num_bytes = time.monotonic(), kv.nbytes
            if state.identity is None or not self._send(state.identity, wire.encode(meta, kv)):
                state.status.fail("KV transfer failed: the decode server disconnected before it began")
        elif kind == "abort":
            reason = cmd[2]
            state.status.fail(reason, ABORTED_STATUS)
            if state.identity is not None:
                self._send(state.identity, wire.encode({"type": "fail", "room": room, "reason": reason}))

    def _on_message(self, identity: bytes, msg: dict[str, Any], payload: bytes | None) -> None:
        kind, room = msg.get("type"), msg.get("room")
        if kind == "init":
            self._on_init(identity, room, msg)
            return
        if kind == "abort":
            with self._rooms_lock:  # the decode side may abort before our request arrived
                state = self.rooms.setdefault(room, _Room(TransferStatus(self.timeout_s)))
            state.status.fail(f"Aborted on the decode server: {msg.get('reason', '')}", ABORTED_STATUS)
            return
        state = self.rooms.get(room)
        if state is None:
            return
        if kind == "ack" and state.status.advance(KVPoll.Success):
            seconds = time.monotonic() - state.send_started
            stats = self.stats
            stats.num_transfers += 1
            stats.bytes += state.num_bytes
            stats.seconds += seconds
            stats.per_transfer = [*stats.per_transfer[-999:], (state.num_bytes, seconds)]

    def _on_init(self, identity: bytes, room: int, msg: dict[str, Any]) -> None:
        with self._rooms_lock:
            state = self.rooms.get(room)
            if state is None:  # the decode side got here first: the room waits for its request
                state = self.rooms[room] = _Room(TransferStatus(self.timeout_s))
        if state.identity is not None and state.identity != identity:
            self._send(identity, wire.encode(_fail(room, f"bootstrap_room {room} is already paired", 400)))
            return
        state.identity = identity
        problem = self._mismatch(msg)
        if problem is not None:
            state.status.fail(problem, 500)
            self._send(identity, wire.encode(_fail(room, problem, 500)))
        elif state.status.poll() == KVPoll.Failed:
            self._send(identity, wire.encode(_fail(room, state.status.error or "failed on prefill", 503)))
        else:
            state.status.advance(KVPoll.WaitingForInput)

    def _mismatch(self, msg: dict[str, Any]) -> str | None:
        if msg.get("page_size") != self.page_size:
            return (
                f"KV page size mismatch: the prefill server has --page-size {self.page_size}, the "
                f"decode server {msg.get('page_size')}; they must match"
            )
        if msg.get("kv_cache_dtype") != self.kv_cache_dtype:
            return (
                f"KV cache dtype mismatch: prefill {self.kv_cache_dtype}, decode "
                f"{msg.get('kv_cache_dtype')}; they must match"
            )
        return None

    def _check_rooms(self) -> None:
        now = time.monotonic()
        ping = now - self._last_ping > wire.PING_INTERVAL_S
        if ping:
            self._last_ping = now
        for room, state in list(self.rooms.items()):
            status = state.status.poll()
            if status in (KVPoll.Success, KVPoll.Failed):
                if not state.claimed and status == KVPoll.Failed:
                    if not state.tombstone_until:
                        state.tombstone_until = now + self.timeout_s
                    elif now > state.tombstone_until:
                        with self._rooms_lock:
                            self.rooms.pop(room, None)
                continue
            if state.status.expired(now):
                self._expire(room, state, status)
            elif (
                ping
                and state.identity is not None
                and not self._send(state.identity, wire.encode({"type": "ping"}))
            ):
                state.status.fail("The decode server disconnected; its KV transfer was abandoned")

    def _expire(self, room: int, state: _Room, status: KVPoll) -> None:
        if status == KVPoll.Bootstrapping:
            what = f"no decode server bootstrapped room {room}"
        elif status == KVPoll.WaitingForInput:
            what = f"room {room}'s prefill did not finish"
        else:
            what = f"the decode server did not acknowledge room {room}'s KV"
        message = f"Disaggregation bootstrap timeout ({self.timeout_s:g} s): {what}"
        if state.status.fail(message) and state.identity is not None:
            self._send(state.identity, wire.encode(_fail(room, message, 503)))
        logger.warning("%s", message)


def _fail(room: int, reason: str, status_code: int) -> dict[str, Any]:
    return {"type": "fail", "room": room, "reason": reason, "status_code": status_code}


class TcpSender:
    def __init__(self, manager: PrefillTcpManager, room: int, state: _Room, owner: bool) -> None:
        self.manager = manager
        self.room = room
        self.state = state
        self.status = state.status
        self.owner = owner

    def poll(self) -> KVPoll:
        return self.status.poll()

    def send(self, kv: torch.Tensor, meta: dict[str, Any]) -> None:
        self.status.advance(KVPoll.Transferring)
        msg = {"type": "kv", "room": self.room, **meta}
        self.manager.command("send", self.room, msg, payload=wire.kv_to_bytes(kv))

    def abort(self, reason: str) -> None:
        if self.owner:
            self.manager.command("abort", self.room, reason)
        self.status.fail(reason, ABORTED_STATUS)

    def close(self) -> None:
        if self.owner:
            self.manager.command("forget", self.room)
