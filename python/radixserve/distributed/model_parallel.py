"""What a model needs to build its part of a multi-rank layout: its TP group and its pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.distributed.communication import TensorParallelComm
from radixserve.distributed.layout import HeadShard, ParallelLayout


@dataclass(frozen=True)
class ModelParallelism:
    tp: TensorParallelComm = field(default_factory=TensorParallelComm.single)
    pp_rank: int = 0
    pp_size: int = 1
    ep_size: int = 1  # MoE experts split whole over this many TP ranks (layers/moe/layer.py)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_layers(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers this stage holds."""
        return ParallelLayout(pp_size=self.pp_size).stage_layers(num_layers, self.pp_rank)

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """This rank's query and KV heads (distributed/layout.py)."""
        return ParallelLayout(tp_size=self.tp.size).attention_heads(num_heads, num_kv_heads, self.tp.rank)
