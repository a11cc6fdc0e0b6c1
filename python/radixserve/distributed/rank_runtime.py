"""One rank's share of a multi-rank layout, as the scheduler process assembles it: the process
groups, the model's parallelism, and the agreements every rank's scheduler must reach together.

Every rank runs the same scheduler over the same inputs and so makes the same decisions. The few
decisions that depend on wall-clock time or on background threads (a grammar compiled, a timeout
expired) are turned into agreements here: each rank proposes its local view and all take the
element-wise AND (or OR) over the world, one small gloo all-reduce, and only when such a decision
is pending. One is agreed on every step while it is in use: the step time the speculative back-off
rule weighs (speculative/batch_gate.py), the slowest rank's. While each rank weighed its own clock,
a busy core could make one rank verify drafts in a step where its peer decoded, and their
collectives summed rows of different requests (issue 35, docs/speculative_decoding.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from radixserve.distributed.communication import TensorParallelComm, all_reduce_ints
from radixserve.distributed.layout import ParallelLayout
from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.distributed.parallel_state import RankGroups, init_rank_groups

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


class RankSync(Protocol):
    """How a scheduler agrees with its peers on decisions its inputs alone do not fix."""

    def all_agree(self, flags: list[bool]) -> list[bool]:
        """Element-wise AND of `flags` over every rank (all ranks pass equal-length lists)."""
        ...

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of `flags` over every rank."""
        ...

    def min_each(self, values: list[int]) -> list[int]:
        """Element-wise MIN of `values` over every rank (e.g. KV transfer statuses)."""
        ...

    def gather(self, obj: object) -> list[object]:
        """Every rank's `obj`, in rank order (for reports, e.g. each rank's KV pool)."""
        ...

    def max_step_seconds(self, seconds: float) -> float:
        """The largest of every rank's `seconds`: a step time that every rank must weigh alike
        (the speculative back-off rule). Called once per step, on the thread that runs the
        forward, between forwards: on one host it rides the TP group's shared-memory
        communicator, which the forward's collectives use too."""
        ...


class LocalSync:
    """A single rank agrees with itself."""

    def all_agree(self, flags: list[bool]) -> list[bool]:
        return list(flags)

    def any_rank(self, flags: list[bool]) -> list[bool]:
        return list(flags)

    def min_each(self, values: list[int]) -> list[int]:
        return list(values)

    def gather(self, obj: object) -> list[object]:
        return [obj]

    def max_step_seconds(self, seconds: float) -> float:
        return seconds


@dataclass(frozen=True)
class RankRuntime:
    groups: RankGroups
    parallel: ModelParallelism

    @property
    def layout(self) -> ParallelLayout:
        return self.groups.layout

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def is_entry_rank(self) -> bool:
        """Rank 0 reads the TokenizerManager's socket and sends every output of the scheduler."""
        return self.groups.rank == 0

    @classmethod
    def start(
        cls,
        layout: ParallelLayout,
        rank: int,
        init_addr: str,
        device: str,
        timeout_s: float | None,
        use_shm: bool,
    ) -> RankRuntime:
        groups = init_rank_groups(layout, rank, init_addr, device, timeout_s)
        fast = None
        if layout.tp_size > 1 and use_shm and device == "cpu":
            fast = _shm_communicator(groups, timeout_s)
        tp = TensorParallelComm(groups.tp_rank, layout.tp_size, groups.tp_device, fast)
        return cls(groups, ModelParallelism(tp, groups.pp_rank, layout.pp_size, layout.ep_size))

    @classmethod
    def for_server(cls, server_args: ServerArgs, rank: int, init_addr: str, device: str) -> RankRuntime:
        """`start` with what the server's flags say: layout, --dist-timeout, and the shared-memory
        all-reduce unless --disable-custom-all-reduce; `device` is this rank's (rank_device)."""
        return cls.start(
            server_args.layout(),
            rank,
            init_addr,
            device,
            server_args.dist_timeout,
            use_shm=not server_args.disable_custom_all_reduce,
        )

    # ------------------------------------------------------------------ agreements
    def min_over_world(self, value: int) -> int:
        return all_reduce_ints([value], dist.ReduceOp.MIN, self.groups.world_cpu)[0]

    def all_agree(self, flags: list[bool]) -> list[bool]:
        values = all_reduce_ints([int(f) for f in flags], dist.ReduceOp.MIN, self.groups.world_cpu)
        return [bool(v) for v in values]

    def any_rank(self, flags: list[bool]) -> list[bool]:
        values = all_reduce_ints([int(f) for f in flags], dist.ReduceOp.MAX, self.groups.world_cpu)
        return [bool(v) for v in values]

    def min_each(self, values: list[int]) -> list[int]:
        return all_reduce_ints(values, dist.ReduceOp.MIN, self.groups.world_cpu)

    def gather(self, obj: object) -> list[object]:
        everyone: list[object] = [None] * self.layout.world_size
        dist.all_gather_object(everyone, obj, group=self.groups.world_cpu)
        return everyone

    def max_step_seconds(self, seconds: float) -> float:
        fast = self.parallel.tp.fast
        if fast is not None and self.layout.pp_size == 1:
            # The TP group is the world. Shared memory answers in microseconds; gloo's loopback
            # round trip (0.2-2 ms) would cost as much as a small model's decode step.
            gathered = fast.all_gather(torch.tensor([seconds], dtype=torch.float32))
            return float(gathered.max())
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups.world_cpu)
        return float(t.item())


def _shm_communicator(groups: RankGroups, timeout_s: float | None) -> object | None:
    """The same-host shared-memory communicator of the TP group, or None (then gloo) when the
    compiled extension is missing or the group spans hosts (it logs which)."""
    try:
        from radixserve.distributed.shm_comm import ShmCommunicator
    except ImportError as exc:
        logger.info("Shared-memory all-reduce unavailable (%s): TP collectives use gloo", exc)
        return None
    kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
    return ShmCommunicator.create(groups.tp_cpu, f"tp{groups.pp_rank}", **kwargs)
