"""ZMQ endpoints between the processes, and small socket helpers."""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
from dataclasses import dataclass, replace

import zmq


@dataclass(frozen=True)
class PortArgs:
    """The ipc:// endpoints of one server. Each endpoint is bound by its PULL (receiving) side.

    They live in a private directory made by `tempfile.mkdtemp` (mode 0700), so two servers on one
    host never collide and other users cannot connect to them.
    """

    ipc_dir: str
    tokenizer_ipc_name: str  # TokenizerManager PULL: BatchStrOut and control outputs
    scheduler_input_ipc_name: str  # scheduler (rank 0) PULL: requests from the TokenizerManager
    detokenizer_ipc_name: str  # detokenizer PULL: BatchTokenIDOut from the scheduler
    rpc_ipc_name: str = ""  # scheduler (rank 0) DEALER: RpcReqInput in, RpcReqOutput back (Engine)
    # With --dp-size > 1 the DataParallelController binds scheduler_input_ipc_name and each
    # replica's rank 0 its own `replica_input(dp_rank)`; replicas report their load to the
    # controller's `dp_controller_ipc_name`. A replica's PortArgs (`for_dp_rank`) carries its rank.
    dp_rank: int = 0
    dp_controller_ipc_name: str | None = None

    @classmethod
    def create(cls) -> PortArgs:
        ipc_dir = tempfile.mkdtemp(prefix="radixserve-ipc-")
        return cls(
            ipc_dir=ipc_dir,
            tokenizer_ipc_name=f"ipc://{os.path.join(ipc_dir, 'tokenizer')}",
            scheduler_input_ipc_name=f"ipc://{os.path.join(ipc_dir, 'scheduler')}",
            detokenizer_ipc_name=f"ipc://{os.path.join(ipc_dir, 'detokenizer')}",
            rpc_ipc_name=f"ipc://{os.path.join(ipc_dir, 'rpc')}",
        )

    def replica_input(self, dp_rank: int) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, f'scheduler-dp{dp_rank}')}"

    def with_dp_controller(self) -> PortArgs:
        return replace(
            self, dp_controller_ipc_name=f"ipc://{os.path.join(self.ipc_dir, 'dp-controller-load')}"
        )

    def for_dp_rank(self, dp_rank: int) -> PortArgs:
        """The endpoints replica `dp_rank`'s rank 0 uses: its own input, the shared outputs."""
        # The RPC channel (the Engine's collective_rpc) reaches replica 0 only: one socket binds it.
        rpc = self.rpc_ipc_name if dp_rank == 0 else ""
        return replace(
            self, scheduler_input_ipc_name=self.replica_input(dp_rank), dp_rank=dp_rank, rpc_ipc_name=rpc
        )

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def get_zmq_socket(context: zmq.Context, socket_type: int, endpoint: str, bind: bool) -> zmq.Socket:
    """A PUSH/PULL socket with unbounded queues.

    The high-water marks are lifted because dropping or blocking on a full queue would lose
    tokens or stall a process loop; the senders' rates are bounded by the scheduler's step rate.
    """
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PICKED_PORT = 10000  # below: well-known and registered services


def ephemeral_port_range(path: str = _EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for automatic ports (bind to 0, outgoing connections), inclusive."""
    try:
        with open(path, encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _pick_ranges(ephemeral: tuple[int, int]) -> list[range]:
    low, high = ephemeral
    ranges = [range(_LOWEST_PICKED_PORT, low), range(high + 1, 65536)]
    return [r for r in ranges if len(r) >= 1000]


def get_free_port(host: str = "127.0.0.1", ephemeral: tuple[int, int] | None = None) -> int:
    """A TCP port that was free a moment ago (for tests, ranks' rendezvous and --port 0).

    Why not simply bind to port 0: the kernel hands that port out again to the next automatic
    bind or outgoing connection anywhere on the host, so between this call and the caller's own
    bind another process (a rank's store, a client socket) could take it: EADDRINUSE. Picking at
    random outside the ephemeral range leaves only another explicit pick to collide with.
    """
    ranges = _pick_ranges(ephemeral or ephemeral_port_range())
    rng = random.SystemRandom()
    for _ in range(64 if ranges else 0):
        r = rng.choice(ranges)
        port = rng.randrange(r.start, r.stop)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
