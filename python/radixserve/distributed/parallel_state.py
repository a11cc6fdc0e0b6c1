"""torch.distributed process groups of one rank: the world, its tensor-parallel group and its
pipeline group, each as a CPU (gloo) group for control and a device group for tensors.

Why two groups per set of ranks: control messages (the scheduler's request broadcast, agreements,
pickled outputs between stages) travel on the scheduler thread while the model's collectives may
run on the overlap loop's forward thread. A process group must see its operations in the same
order on every rank, so the two streams of operations get separate groups. On CPU both are gloo;
on CUDA the device groups are NCCL.

Every rank calls `init_rank_groups` with the same layout; torch.distributed requires every rank to
create every group (also the ones it is not in) in the same order, which the loops below do.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from radixserve.distributed.layout import ParallelLayout, RankInfo

logger = logging.getLogger(__name__)

# Default for --dist-timeout: a collective waits this long for a peer before raising. A peer that
# died is detected sooner (its sockets close); this bounds a peer that hangs.
DEFAULT_DIST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankGroups:
    layout: ParallelLayout
    info: RankInfo
    world_cpu: dist.ProcessGroup
    tp_cpu: dist.ProcessGroup
    tp_device: dist.ProcessGroup
    pp_cpu: dist.ProcessGroup  # the ranks of this TP index across stages: requests, outputs
    pp_device: dist.ProcessGroup  # the same ranks: hidden states between stages

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def tp_rank(self) -> int:
        return self.info.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.info.pp_rank

    def peer_in_stage(self, pp_rank: int) -> int:
        """The global rank with this rank's TP index in stage `pp_rank`."""
        return self.layout.rank_of(pp_rank, self.info.tp_rank)


def init_rank_groups(
    layout: ParallelLayout, rank: int, init_addr: str, device: str, timeout_s: float | None = None
) -> RankGroups:
    """Join the world (rank 0 hosts the rendezvous store at `init_addr`) and create the groups."""
    host, _, port = init_addr.rpartition(":")
    _pick_gloo_interface(host)
    timeout = timedelta(seconds=timeout_s or DEFAULT_DIST_TIMEOUT_S)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{host}:{port}",
        world_size=layout.world_size,
        rank=rank,
        timeout=timeout,
    )
    device_backend = "nccl" if cuda else "gloo"

    def cpu_and_device(ranks: list[int]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        # new_group is collective: every rank creates every group, in this same order.
        cpu = dist.new_group(ranks, timeout=timeout, backend="gloo")
        return cpu, dist.new_group(ranks, timeout=timeout, backend=device_backend)

    tp_groups = {pp: cpu_and_device(layout.tp_group_ranks(pp)) for pp in range(layout.pp_size)}
    pp_groups = {tp: cpu_and_device(layout.pp_group_ranks(tp)) for tp in range(layout.tp_size)}
    info = layout.rank_info(rank)
    world_cpu = dist.new_group(list(range(layout.world_size)), timeout=timeout, backend="gloo")
    groups = RankGroups(
        layout=layout,
        info=info,
        world_cpu=world_cpu,
        tp_cpu=tp_groups[info.pp_rank][0],
        tp_device=tp_groups[info.pp_rank][1],
        pp_cpu=pp_groups[info.tp_rank][0],
        pp_device=pp_groups[info.tp_rank][1],
    )
    logger.info(
        "Rank %d (tp %d/%d, pp %d/%d, node %d) joined the world of %d at %s",
        rank,
        info.tp_rank,
        layout.tp_size,
        info.pp_rank,
        layout.pp_size,
        info.node_rank,
        layout.world_size,
        init_addr,
    )
    return groups


def _pick_gloo_interface(host: str) -> None:
    """gloo listens on the interface of the machine's hostname unless told otherwise; when the
    world meets on the loopback address, every rank is on this host, so use loopback (the
    hostname may resolve to an address that is not reachable in containers)."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and host in ("127.0.0.1", "localhost", "::1"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
