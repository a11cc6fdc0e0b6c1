"""The process group a trainer broadcasts new weights over (update_weights_from_distributed).

The trainer is rank 0 and hosts the rendezvous store at master_address:master_port; this server's
TP rank r joins as rank `rank_offset + r`. The group is separate from the server's own ranks
(their default group is untouched), and both sides build it with `init_weights_group` under the
same `group_name` (docs/rl.md shows the trainer's side).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
GROUP_TIMEOUT = datetime.timedelta(seconds=300)


def init_weights_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout: datetime.timedelta = GROUP_TIMEOUT,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group `group_name`; returns its ProcessGroup."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA devices; use 'gloo' on CPU")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group's world_size {world_size}")
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"{group_name}/", store)
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return group


def broadcast_from_trainer(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Receive `tensor` (filled in place) from the group's rank 0."""
    group.broadcast(tensor, 0).wait()
