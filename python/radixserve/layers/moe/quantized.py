"""Weight-only quantized experts (--quantization gguf on a MoE file): each local expert's gate/up
and down projections as GroupQuantWeights, the GGUF file's own integers and scales.

FusedMoE keeps its fp32 stacked weights beside them (the file dequantized, equal to these forms'
dequantization: checked when they are attached), so an expert whose group of tokens is larger than
`wq_max_tokens` (layers/cpu_crossovers.py) reads fp32, as a dense Linear's large batches do (layers/linear.py); small groups, the
decode case, stream the quantized integers through linear_wq.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers.group_quant import GroupQuantWeight


@dataclass(frozen=True)
class ExpertsWq:
    """w13[e]: local expert e's gate rows then up rows [2 * inter, hidden_size]; w2[e]: its down
    projection [hidden_size, inter] (FusedMoE's w13_weight / w2_weight layout, one expert each)."""

    w13: tuple[GroupQuantWeight, ...]
    w2: tuple[GroupQuantWeight, ...]

    def __post_init__(self) -> None:
        if len(self.w13) != len(self.w2):
            raise ValueError(f"{len(self.w13)} gate/up forms but {len(self.w2)} down forms")

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (w13 [num_local, 2 * inter, hidden], w2 [num_local, hidden, inter])."""
        return (
            torch.stack([w.dequantize() for w in self.w13]),
            torch.stack([w.dequantize() for w in self.w2]),
        )

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in (*self.w13, *self.w2))
