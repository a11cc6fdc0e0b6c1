"""Which ranks exist, where they run, and what each one holds: pure arithmetic, no processes.

Ranks are numbered as SGLang numbers them: rank = pp_rank * tp_size + tp_rank, so one pipeline
stage is a run of tp_size consecutive ranks. Node n of `nnodes` runs the ranks
[n * ranks_per_node, (n + 1) * ranks_per_node); rank 0 (the first rank of the first stage) is on
node 0, the node that serves HTTP.

    layout = ParallelLayout(tp_size=2, pp_size=2, nnodes=2, node_rank=1)
    layout.local_ranks()             # (2, 3): the second stage runs on node 1
    layout.stage_layers(30, 1)       # (15, 30)
    layout.attention_heads(9, 3, 1)  # HeadShard(q_start=6, q_count=3, kv_start=2, kv_count=1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message says which flag to change."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    tp_rank: int
    pp_rank: int
    node_rank: int
    local_rank: int  # index among the ranks of this node (GPU index, share of the cores)


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: query heads [q_start, q_start + q_count) and KV heads
    [kv_start, kv_start + kv_count) of the model's."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dp_size: int = 1  # data-parallel replicas of this layout on this machine (they share its cores)
    ep_size: int = 1  # MoE experts split whole over this many of the TP ranks (--ep-size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def check(self) -> None:
        """Refuse layouts that cannot be laid out, whatever the model."""
        for name, value in (
            ("--tp-size", self.tp_size),
            ("--pp-size", self.pp_size),
            ("--nnodes", self.nnodes),
        ):
            if value < 1:
                raise LayoutError(f"{name} must be >= 1, got {value}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise LayoutError(
                f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size}: experts are split over "
                "the tensor-parallel ranks (attention stays tensor-parallel)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise LayoutError(f"--node-rank must be in [0, --nnodes={self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise LayoutError(
                f"--tp-size x --pp-size = {self.world_size} ranks cannot be split evenly over "
                f"--nnodes {self.nnodes}: make the number of ranks a multiple of the number of nodes"
            )

    def check_model(self, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
        """Refuse layouts this model cannot be split into (at start, before any rank is waited on)."""
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise LayoutError(f"the model's {num_heads} attention heads do not form {num_kv_heads} KV groups")
        if self.tp_size > num_kv_heads:
            # More ranks than KV heads: each KV head is replicated on tp_size / num_kv_heads ranks,
            # which split its query heads evenly.
            if self.tp_size % num_kv_heads or num_heads % self.tp_size:
                raise LayoutError(
                    f"--tp-size {self.tp_size} exceeds the model's {num_kv_heads} KV heads, so each "
                    f"KV head must be replicated on an equal number of ranks and the {num_heads} "
                    f"attention heads split evenly: use a --tp-size up to {num_kv_heads}, or a "
                    f"multiple of {num_kv_heads} that divides {num_heads}"
                )
        if intermediate_size % self.tp_size:
            raise LayoutError(
                f"--tp-size {self.tp_size} does not divide the model's MLP width ({intermediate_size}): "
                "use a --tp-size that divides it"
            )
        if self.pp_size > num_layers:
            raise LayoutError(
                f"--pp-size {self.pp_size} is larger than the model's {num_layers} layers: every "
                f"pipeline stage needs at least one layer"
            )

    # ------------------------------------------------------------------ ranks
    def rank_info(self, rank: int) -> RankInfo:
        return RankInfo(
            rank=rank,
            tp_rank=rank % self.tp_size,
            pp_rank=rank // self.tp_size,
            node_rank=rank // self.ranks_per_node,
            local_rank=rank % self.ranks_per_node,
        )

    def local_ranks(self) -> tuple[int, ...]:
        first = self.node_rank * self.ranks_per_node
        return tuple(range(first, first + self.ranks_per_node))

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def tp_group_ranks(self, pp_rank: int) -> list[int]:
        return [self.rank_of(pp_rank, t) for t in range(self.tp_size)]

    def pp_group_ranks(self, tp_rank: int) -> list[int]:
        return [self.rank_of(p, tp_rank) for p in range(self.pp_size)]

    # ------------------------------------------------------------------ model split
    def stage_layers(self, num_layers: int, pp_rank: int) -> tuple[int, int]:
        """[start, end) of the layers stage `pp_rank` holds; earlier stages take the remainder
        (the last stage also runs the final norm, the LM head and sampling)."""
        base, extra = divmod(num_layers, self.pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        return start, start + base + (1 if pp_rank < extra else 0)

    def attention_heads(self, num_heads: int, num_kv_heads: int, tp_rank: int) -> HeadShard:
        """The query and KV heads TP rank `tp_rank` holds.

        Heads are split by KV group (query head h attends with KV head h // (num_heads /
        num_kv_heads)), so a rank never needs another rank's KV. With tp_size <= num_kv_heads each
        rank takes a contiguous block of whole groups, one more group on the first ranks when
        they do not divide evenly (SmolLM2-135M's 3 KV heads at tp_size 2: 2 and 1). With more
        ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads ranks, which
        split its group's query heads.
        """
        group = num_heads // num_kv_heads
        if self.tp_size <= num_kv_heads:
            base, extra = divmod(num_kv_heads, self.tp_size)
            kv_start = tp_rank * base + min(tp_rank, extra)
            kv_count = base + (1 if tp_rank < extra else 0)
            return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
        q_count = num_heads // self.tp_size
        return HeadShard(tp_rank * q_count, q_count, tp_rank * num_kv_heads // self.tp_size, 1)

    # ------------------------------------------------------------------ cores
    def cpu_cores(self, local_rank: int, threads: int | None, dp_rank: int = 0) -> tuple[int, list[int]]:
        """(torch threads, cores to pin to) of one rank: this process's cores split evenly between
        the node's ranks of every data-parallel replica, so no two ranks contend for a core.
        `threads` caps the total."""
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        total = min(threads or len(cores) or 1, len(cores) or (threads or 1))
        slots = self.ranks_per_node * self.dp_size
        per_rank = max(1, total // slots)
        if len(cores) < slots:
            return per_rank, []  # fewer cores than ranks: pinning would stack ranks anyway
        slot = dp_rank * self.ranks_per_node + local_rank
        share = cores[slot * per_rank : (slot + 1) * per_rank]
        return per_rank, share
