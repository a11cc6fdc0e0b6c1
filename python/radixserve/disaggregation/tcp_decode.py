"""The built-in `tcp` backend, decode side: per prefill server, one DEALER socket to each of its
prefill ranks, all served by one I/O thread.

A room bootstraps by asking the prefill server's bootstrap server for its layout (GET /route with
engine_rank=-1: page size, KV dtype and the model's KV shape must match ours) and the address and
KV heads of each rank of each of its data-parallel replicas, then connects to every one of them.
A room's KV comes from one replica (SGLang's rule): the one disagg_prefill_dp_rank names, else
bootstrap_room modulo the replicas when the prefill server places rooms that way
(follow_bootstrap_room), else the one its bootstrap server says (POST /query_dp_ranks). Each rank of a multi-rank
decode server runs one of these: it asks every prefill rank for the KV heads it owns that this
prefill rank is the first to hold (heads.py), and the room succeeds once every prefill rank's kv
message arrived. A prefill server that dies is noticed from the socket monitors
(EVENT_DISCONNECTED): every room still waiting on it fails at once.

The I/O thread's poller is built once; sockets are registered when a peer connects and
unregistered when it goes away.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from radixserve.disaggregation import wire
from radixserve.disaggregation.backend import KVResult
from radixserve.disaggregation.decode_peers import DRoom, Link, Peer, abort_msg, fetch_json
from radixserve.disaggregation.heads import HeadRange, KVLayout, pull_plan
from radixserve.disaggregation.io_thread import KVIoThread, TcpHandle
from radixserve.disaggregation.mooncake_engine import MooncakeEngine, kv_nbytes
from radixserve.disaggregation.utils import ABORTED_STATUS, KVPoll, TransferStatus

logger = logging.getLogger(__name__)

BOOTSTRAP_RETRY_S = 0.25


class DecodeTcpManager(KVIoThread):
    def __init__(self, layout: KVLayout, timeout_s: float, mooncake: MooncakeEngine | None = None) -> None:
        super().__init__("decode", layout, timeout_s, mooncake)
        self.rooms: dict[int, DRoom] = {}
        self.peers: dict[tuple[str, int], Peer] = {}
        self.bytes_received = 0
        # socket -> (peer, (dp group, TP rank)), or (peer, None) for a monitor
        self._owners: dict[zmq.Socket, tuple[Peer, tuple[int, int] | None]] = {}
        self.thread.start()

    # ------------------------------------------------------------------ scheduler thread
    def create_receiver(
        self, room: int, host: str, port: int, prefill_dp_rank: int | None = None
    ) -> TcpReceiver:
        state = DRoom(TransferStatus(self.timeout_s), (host, port), dp_rank=prefill_dp_rank)
        if room in self.rooms:
            state.status.fail(f"bootstrap_room {room} is already in use on this decode server", 400)
            return TcpReceiver(self, room, state, owner=False)
        self.rooms[room] = state
        self.command("bootstrap", room)
        return TcpReceiver(self, room, state, owner=True)

    # ------------------------------------------------------------------ I/O thread
    def _on_tick(self, ready: dict[zmq.Socket, int]) -> None:
        for sock in [s for s in ready if s is not self._cmd_in]:
            self._on_ready(sock)
        self._connect_pending()
        self._check_timeouts()

    def _on_ready(self, sock: zmq.Socket) -> None:
        owner = self._owners.get(sock)
        if owner is None:  # its peer was dropped earlier in this tick
            return
        peer, where = owner
        if where is None:
            self._on_monitor(peer, sock)
            return
        while sock in self._owners and sock.poll(0):
            self._on_message(peer, where, *wire.decode(sock.recv_multipart(copy=False)))

    def _links(self, peer: Peer, room: int) -> list[Link]:
        """The links to the replica holding the room, or to every replica while that is unknown
        (an abort or a layout complaint then reaches the one that holds it)."""
        state = self.rooms.get(room)
        if state is not None and state.group is not None:
            return peer.groups[state.group]
        return peer.links

    def _send_all(self, peer: Peer, frames: wire.MsgFrames, room: int | None = None) -> None:
        for link in peer.links if room is None else self._links(peer, room):
            link.dealer.send_multipart(frames)

    def _on_command(self, cmd: tuple[Any, ...], payload: None = None) -> None:
        kind, room = cmd[0], cmd[1]
        state = self.rooms.get(room)
        if state is None:
            return
        peer = self.peers.get(state.peer)
        if kind == "bootstrap":
            if peer is None:
                peer = self.peers[state.peer] = Peer(state.peer)
            peer.rooms.add(room)
            if peer.problem is not None:
                state.status.fail(peer.problem, 500)
                if peer.connected:
                    self._send_init(peer, room, 0)  # the prefill side sees the mismatch too
            elif peer.connected:
                self._place(peer, room)
        elif kind == "init" and peer is not None and peer.connected:
            self._send_init(peer, room, cmd[2])
        elif kind == "abort" and peer is not None:
            # Not connected yet: the prefill server must still hear it, or its request would
            # wait for us until the bootstrap timeout.
            if not peer.connected:
                peer.pending_aborts.append((room, cmd[2], time.monotonic() + self.timeout_s))
            else:
                self._send_all(peer, abort_msg(room, cmd[2]), room)
        elif kind == "forget":
            for buf in state.buffers.values():
                assert self.mooncake is not None
                self.mooncake.retire(buf)
            del self.rooms[room]
            if peer is not None:
                peer.rooms.discard(room)

    def _place(self, peer: Peer, room: int) -> None:
        """Find the prefill replica holding the room (SGLang's order: disagg_prefill_dp_rank, one
        replica, the room modulo the replicas under follow_bootstrap_room); the room is then
        WaitingForInput. Otherwise it waits for _query_rooms."""
        state, replicas = self.rooms[room], len(peer.groups)
        if state.dp_rank is not None and state.dp_rank >= replicas:
            host, port = peer.key
            message = (
                f"disagg_prefill_dp_rank {state.dp_rank} is out of range: the prefill server "
                f"(bootstrap {host}:{port}) runs {replicas} data-parallel replica(s), ranks 0 to "
                f"{replicas - 1}."
            )
            if state.status.fail(message, 400):
                self._send_all(peer, abort_msg(room, message))  # its prefill half ends too
            return
        if state.dp_rank is not None:
            state.group = state.dp_rank
        elif replicas == 1:
            state.group = 0
        elif peer.follow_bootstrap_room:
            state.group = room % replicas
        else:
            return
        state.status.advance(KVPoll.WaitingForInput)

    def _query_rooms(self, peer: Peer, now: float) -> None:
        """POST /query_dp_ranks for the rooms whose replica only the bootstrap server knows."""
        waiting = [
            r
            for r in peer.rooms
            if r in self.rooms
            and self.rooms[r].group is None
            and self.rooms[r].status.poll() == KVPoll.Bootstrapping
        ]
        if not waiting or now < peer.next_query:
            return
        peer.next_query = now + BOOTSTRAP_RETRY_S
        host, port = peer.key
        try:
            found = fetch_json(f"http://{host}:{port}/query_dp_ranks", {"bootstrap_rooms": waiting})
        except (OSError, ValueError) as exc:
            logger.debug("Query of rooms' replicas at %s:%d failed: %s", host, port, exc)
            return
        for room in waiting:
            if str(room) in found:
                self.rooms[room].dp_rank = int(found[str(room)])
                self._place(peer, room)

    def _send_init(self, peer: Peer, room: int, num_tokens: int) -> None:
        layout, state = self.layout, self.rooms[room]
        for r, link in enumerate(self._links(peer, room)):
            msg = {
                "type": "init",
                "room": room,
                "page_size": self.page_size,
                "kv_cache_dtype": self.kv_cache_dtype,
                "num_tokens": num_tokens,
                "decode_rank": layout.tp_rank,
                "decode_tp_size": layout.tp_size,
                "heads": list(link.heads),
                **layout.model_dims(),
            }
            if self.mooncake is not None and num_tokens > 0 and link.heads[0] < link.heads[1]:
                size = kv_nbytes(
                    layout.num_layers, layout.head_dim, link.heads, num_tokens, self.kv_cache_dtype
                )
                state.buffers[r] = self.mooncake.receive_buffer(size)
                msg.update(
                    mooncake_session=self.mooncake.session_id,
                    mooncake_ptr=state.buffers[r].data_ptr(),
                    mooncake_len=size,
                )
            link.dealer.send_multipart(wire.encode(msg))

    def _on_message(
        self, peer: Peer, where: tuple[int, int], msg: dict[str, Any], payload: memoryview | None
    ) -> None:
        kind, room = msg.get("type"), msg.get("room")
        state = self.rooms.get(room) if room is not None else None
        group, rank = where
        if state is not None and state.group is not None and state.group != group:
            state = None  # another replica's word on a room it does not hold
        if kind == "kv":
            peer.groups[group][rank].dealer.send_multipart(wire.encode({"type": "ack", "room": room}))
            if state is not None and state.status.poll() == KVPoll.Transferring:
                if msg.get("mooncake_len") is not None:  # written into our buffer before this message
                    payload = memoryview(state.buffers[rank].numpy())
                state.pieces[rank] = (msg, payload)
                self.bytes_received += len(payload) if payload is not None else 0
                if len(state.pieces) == len(peer.groups[group]):  # every prefill rank's part is here
                    state.status.advance(KVPoll.Success)
        elif kind == "fail" and state is not None:
            state.status.fail(
                f"Failed on the prefill server: {msg.get('reason')}", msg.get("status_code", 503)
            )

    def _on_monitor(self, peer: Peer, monitor: zmq.Socket) -> None:
        while monitor in self._owners and monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                host, port = peer.key
                message = f"The prefill server (bootstrap {host}:{port}) disconnected during the KV transfer"
                logger.warning("%s; failing %d request(s)", message, len(peer.rooms))
                for room in peer.rooms:
                    if room in self.rooms:
                        self.rooms[room].status.fail(message)
                self._drop_peer(peer)

    def _drop_peer(self, peer: Peer) -> None:
        for link in peer.links:
            for sock in (link.monitor, link.dealer):
                self.poller.unregister(sock)
                self._owners.pop(sock, None)
                sock.close(linger=0)
        peer.groups = []
        self.peers.pop(peer.key, None)

    def _connect_pending(self) -> None:
        now = time.monotonic()
        for peer in list(self.peers.values()):
            if peer.connected and peer.problem is None:
                self._query_rooms(peer, now)
            if peer.connected or peer.problem is not None or now < peer.next_try:
                continue
            peer.pending_aborts = [a for a in peer.pending_aborts if a[2] > now]
            rooms = [self.rooms[r] for r in peer.rooms if r in self.rooms]
            waiting = any(state.status.poll() == KVPoll.Bootstrapping for state in rooms)
            if not waiting and not peer.pending_aborts:
                if not peer.rooms:
                    self.peers.pop(peer.key, None)
                continue
            peer.next_try = now + BOOTSTRAP_RETRY_S
            self._bootstrap(peer)

    def _bootstrap(self, peer: Peer) -> None:
        host, port = peer.key
        try:
            info = fetch_json(f"http://{host}:{port}/route?engine_rank=-1&target_dp_group=-1")
            groups = [
                [
                    fetch_json(f"http://{host}:{port}/route?engine_rank={r}&target_dp_group={g}")
                    for r in range(int(info.get("tp_size", 1)))
                ]
                for g in range(int(info.get("dp_size", 1)))
            ]
        except (OSError, ValueError) as exc:  # not up yet, or not every prefill rank registered
            logger.debug("Bootstrap %s:%d not ready: %s", host, port, exc)
            return
        peer.follow_bootstrap_room = bool(info.get("follow_bootstrap_room", True))
        plan = self._plan(peer, info, groups[0])  # every replica has the same TP layout
        for g, ranks in enumerate(groups):
            links = []
            for r, rank in enumerate(ranks):
                dealer = self.ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                dealer.connect(f"tcp://{rank['rank_ip']}:{rank['rank_port']}")
                links.append(Link(dealer, monitor, plan[r]))
                for sock, owner in ((dealer, (g, r)), (monitor, None)):
                    self.poller.register(sock, zmq.POLLIN)
                    self._owners[sock] = (peer, owner)
            peer.groups.append(links)
        for room, reason, _ in peer.pending_aborts:
            self._send_all(peer, abort_msg(room, reason))
        peer.pending_aborts.clear()
        for room in list(peer.rooms):
            if room not in self.rooms:
                continue
            if peer.problem is None:
                self._place(peer, room)
            else:  # fail here, and let the prefill side see the mismatch from our init
                self.rooms[room].status.fail(peer.problem, 500)
                self._send_init(peer, room, 0)

    def _plan(self, peer: Peer, info: dict[str, Any], ranks: list[dict[str, Any]]) -> list[HeadRange]:
        """The heads this rank takes from each prefill rank; sets peer.problem where the two
        servers' KV cannot be matched (every prefill rank then gets an empty request)."""
        host, port = peer.key
        layout = self.layout
        if info.get("page_size") != self.page_size or info.get("kv_cache_dtype") != self.kv_cache_dtype:
            peer.problem = (
                f"KV layout mismatch: the prefill server (bootstrap {host}:{port}) has page_size "
                f"{info.get('page_size')} and KV dtype {info.get('kv_cache_dtype')}, this decode server "
                f"page_size {self.page_size} and {self.kv_cache_dtype}; they must match"
            )
        else:
            peer.problem = layout.model_mismatch(info, f"prefill server (bootstrap {host}:{port})")
        if peer.problem is None:
            default = (0, layout.num_kv_heads)
            held = [
                (int(r.get("kv_head_start", default[0])), int(r.get("kv_head_stop", default[1])))
                for r in ranks
            ]
            try:
                return pull_plan(layout.heads, held)
            except ValueError as exc:
                peer.problem = (
                    f"KV heads cannot be matched between the prefill server's --tp-size "
                    f"{info.get('tp_size')} and this decode server's --tp-size {layout.tp_size}: {exc}"
                )
        logger.error("%s", peer.problem)
        return [(layout.heads[0], layout.heads[0])] * len(ranks)

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for room, state in list(self.rooms.items()):
            status = state.status.poll()
            if not state.status.expired(now):
                continue
            host, port = state.peer
            peer = self.peers.get(state.peer)
            if status == KVPoll.Bootstrapping and peer is not None and peer.connected:
                what = (
                    f"the prefill server (bootstrap {host}:{port}) did not say which replica holds the room"
                )
            elif status == KVPoll.Bootstrapping:
                what = f"the prefill server's bootstrap server at {host}:{port} did not answer"
            elif status == KVPoll.WaitingForInput:
                what = "no KV pages were free on this decode server"
            else:
                what = f"no KV arrived from the prefill server (bootstrap {host}:{port})"
            message = f"Disaggregation bootstrap timeout ({self.timeout_s:g} s): {what}"
            if state.status.fail(message):
                logger.warning("Room %d: %s", room, message)
                if peer is not None and peer.connected:
                    self._send_all(peer, abort_msg(room, message), room)


class TcpReceiver(TcpHandle):
    def __init__(self, manager: DecodeTcpManager, room: int, state: DRoom, owner: bool) -> None:
        super().__init__(manager, room, state.status, owner)
        self.state = state

    def init(self, num_tokens: int) -> None:
        if self.status.advance(KVPoll.Transferring):
            self.manager.command("init", self.room, num_tokens)

    def result(self) -> KVResult:
        pieces = self.state.pieces
        assert self.status.poll() == KVPoll.Success and pieces, "result() before Success"
        first = pieces[min(pieces)][0]  # every prefill rank sampled the same first token
        return first, [(msg, data) for msg, data in pieces.values() if data is not None]

    def abort(self, reason: str) -> None:
        if self.owner and self.status.fail(reason, ABORTED_STATUS):
            self.manager.command("abort", self.room, reason)
