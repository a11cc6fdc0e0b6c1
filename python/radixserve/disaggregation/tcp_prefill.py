"""The built-in `tcp` backend, prefill side: one ZMQ ROUTER socket that every decode server's
DEALER connects to, served by one I/O thread.

The scheduler thread only creates senders and queues commands (an inproc PUSH the I/O thread
reads); the I/O thread owns the ROUTER, updates each room's TransferStatus and enforces the
timeouts. Each prefill rank runs one; every decode rank of the peer sends it an init per room
(naming the KV heads it wants from this rank, heads.py) and gets one kv message back: the room
is WaitingForInput once all the decode ranks' inits arrived, Success once all acknowledged. A decode server that goes away is noticed by ROUTER_MANDATORY: a send or a liveness ping
to its identity fails with EHOSTUNREACH once ZMQ saw the TCP connection close.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.disaggregation import wire
from radixserve.disaggregation.backend import GatherKV
from radixserve.disaggregation.heads import KVLayout
from radixserve.disaggregation.io_thread import KVIoThread, TcpHandle
from radixserve.disaggregation.mooncake_engine import MooncakeEngine
from radixserve.disaggregation.utils import ABORTED_STATUS, KVPoll, TransferStatus

logger = logging.getLogger(__name__)

# How long a rank retries registering with its bootstrap server (another replica may host it).
REGISTER_TIMEOUT_S = 180


@dataclass(frozen=True)
class ReplicaInfo:
    """Which data-parallel replica a prefill rank belongs to, and how its server places rooms."""

    dp_rank: int = 0
    dp_size: int = 1
    load_balance_method: str = "follow_bootstrap_room"


@dataclass
class _Target:
    """One decode rank of a room: its DEALER and the KV heads it takes from this rank."""

    identity: bytes
    heads: tuple[int, int]
    acked: bool = False
    mooncake: tuple[str, int, int] | None = None  # its receive buffer: (session, address, bytes)


@dataclass
class _Room:
    status: TransferStatus
    claimed: bool = False  # a prefill request owns it (else only a decode side asked for it)
    targets: dict[int, _Target] = field(default_factory=dict)  # decode tp rank -> its DEALER
    decode_tp_size: int | None = None
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


class PrefillTcpManager(KVIoThread):
    def __init__(
        self, bind_host: str, layout: KVLayout, timeout_s: float, mooncake: MooncakeEngine | None = None
    ) -> None:
        super().__init__("prefill", layout, timeout_s, mooncake)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.rank_ip = bind_host
        self.rank_port = self.router.bind_to_random_port(f"tcp://{bind_host}")
        self.poller.register(self.router, zmq.POLLIN)
        self.rooms: dict[int, _Room] = {}
        self._rooms_lock = threading.Lock()
        self.stats = TransferStats()
        self._last_ping = float("-inf")  # monotonic time starts near 0 at boot
        self.thread.start()

    # ------------------------------------------------------------------ scheduler thread
    def register(self, bootstrap_host: str, bootstrap_port: int, replicas: ReplicaInfo | None = None) -> None:
        """PUT /route on the bootstrap server (retried for a while: it starts in replica 0's TP rank
        0, which may still be loading its model)."""
        layout = self.layout
        replicas = replicas or ReplicaInfo()
        body = json.dumps(
            {
                "role": "Prefill",
                "rank_ip": self.rank_ip,
                "rank_port": self.rank_port,
                "engine_rank": layout.tp_rank,
                "tp_size": layout.tp_size,
                "dp_size": replicas.dp_size,
                "system_dp_size": replicas.dp_size,
                "system_dp_rank": replicas.dp_rank,
                "load_balance_method": replicas.load_balance_method,
                "page_size": self.page_size,
                "kv_cache_dtype": self.kv_cache_dtype,
                "kv_head_start": layout.heads[0],
                "kv_head_stop": layout.heads[1],
                **layout.model_dims(),
            }
        ).encode()
        url = f"http://{bootstrap_host}:{bootstrap_port}/route"
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
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

    # ------------------------------------------------------------------ I/O thread
    def _on_tick(self, ready: dict[zmq.Socket, int]) -> None:
        if self.router in ready:
            while self.router.poll(0):
                identity, *frames = self.router.recv_multipart()
                self._on_message(identity, *wire.decode(frames))
        self._check_rooms()

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
            decode_rank, meta = cmd[2], cmd[3]
            if not state.send_started:
                state.send_started = time.monotonic()
            state.num_bytes += payload.nbytes if payload is not None else 0
            target = state.targets.get(decode_rank)
            if target is None:
                state.status.fail("KV transfer failed: the decode server disconnected before it began")
                return
            if payload is not None and target.mooncake is not None and self.mooncake is not None:
                error = self.mooncake.write(payload, *target.mooncake)
                if error is not None:
                    message = f"KV transfer failed: {error}"
                    state.status.fail(message)
                    self._send_all(state, _fail(room, message, 503))
                    return
                meta, payload = {**meta, "mooncake_len": target.mooncake[2]}, None
            if not self._send(target.identity, wire.encode(meta, payload)):
                state.status.fail("KV transfer failed: the decode server disconnected before it began")
        elif kind == "abort":
            reason = cmd[2]
            state.status.fail(reason, ABORTED_STATUS)
            self._send_all(state, {"type": "fail", "room": room, "reason": reason})

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
        if kind != "ack":
            return
        for target in state.targets.values():
            target.acked = target.acked or target.identity == identity
        done = len(state.targets) == state.decode_tp_size and all(t.acked for t in state.targets.values())
        if done and state.status.advance(KVPoll.Success):
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
        decode_rank = int(msg.get("decode_rank", 0))
        decode_tp_size = int(msg.get("decode_tp_size", 1))
        target = state.targets.get(decode_rank)
        if target is not None and target.identity != identity:
            self._send(identity, wire.encode(_fail(room, f"bootstrap_room {room} is already paired", 400)))
            return
        heads = msg.get("heads")
        buffer = msg.get("mooncake_session"), msg.get("mooncake_ptr"), msg.get("mooncake_len")
        state.targets[decode_rank] = _Target(
            identity,
            tuple(heads) if heads else self.layout.heads,
            mooncake=(str(buffer[0]), int(buffer[1]), int(buffer[2])) if buffer[0] is not None else None,
        )
        problem = self._mismatch(msg, state.targets[decode_rank].heads)
        if state.decode_tp_size is not None and state.decode_tp_size != decode_tp_size:
            problem = f"room {room}'s decode ranks disagree on their TP size"
        state.decode_tp_size = decode_tp_size
        if problem is not None:
            state.status.fail(problem, 500)
            self._send(identity, wire.encode(_fail(room, problem, 500)))
        elif state.status.poll() == KVPoll.Failed:
            self._send(identity, wire.encode(_fail(room, state.status.error or "failed on prefill", 503)))
        elif len(state.targets) == decode_tp_size:  # every decode rank allocated
            state.status.advance(KVPoll.WaitingForInput)

    def _send_all(self, state: _Room, msg: dict[str, Any]) -> None:
        for target in list(state.targets.values()):
            self._send(target.identity, wire.encode(msg))

    def _mismatch(self, msg: dict[str, Any], heads: tuple[int, int]) -> str | None:
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
        mine = self.layout.heads
        if heads[0] < heads[1] and not (mine[0] <= heads[0] and heads[1] <= mine[1]):
            return (
                f"decode rank {msg.get('decode_rank')} asked prefill rank {self.layout.tp_rank} for "
                f"KV heads [{heads[0]}, {heads[1]}); it holds [{mine[0]}, {mine[1]})"
            )
        return self.layout.model_mismatch(msg, "decode server")

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
            elif ping and not all(
                self._send(t.identity, wire.encode({"type": "ping"})) for t in list(state.targets.values())
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
        if state.status.fail(message):
            self._send_all(state, _fail(room, message, 503))
        logger.warning("%s", message)


def _fail(room: int, reason: str, status_code: int) -> dict[str, Any]:
    return {"type": "fail", "room": room, "reason": reason, "status_code": status_code}


class TcpSender(TcpHandle):
    def __init__(self, manager: PrefillTcpManager, room: int, state: _Room, owner: bool) -> None:
        super().__init__(manager, room, state.status, owner)
        self.state = state

    def send(self, meta: dict[str, Any], gather: GatherKV) -> None:
        """One kv message per decode rank: the heads it asked this rank for (maybe none)."""
        self.status.advance(KVPoll.Transferring)
        layout = self.manager.layout
        for decode_rank, target in sorted(self.state.targets.items()):
            a, b = target.heads
            msg = {"type": "kv", "room": self.room, "prefill_rank": layout.tp_rank, "heads": [a, b], **meta}
            payload = None
            if a < b:
                kv = gather((a - layout.heads[0], b - layout.heads[0]))
                msg.update(shape=list(kv.shape), dtype=wire.dtype_name(kv.dtype))
                payload = wire.kv_to_bytes(kv)
            self.manager.command("send", self.room, decode_rank, msg, payload=payload)

    def abort(self, reason: str) -> None:
        if self.owner:
            self.manager.command("abort", self.room, reason)
        self.status.fail(reason, ABORTED_STATUS)
