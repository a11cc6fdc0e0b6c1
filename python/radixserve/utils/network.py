"""ZMQ endpoints between the processes, and small socket helpers."""

from __future__ import annotations

import os
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


def get_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and --port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
