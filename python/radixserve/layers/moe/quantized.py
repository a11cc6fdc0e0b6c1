"""Weight-only quantized experts (--quantization gguf on a MoE file): each local expert's gate/up
and down projections as GroupQuantWeights, the GGUF file's own integers and scales.

Once attached (FusedMoE.attach_quantized) they are the experts' only resident form: the fp32
stacked weights are dropped (their storage freed, their shapes kept on the meta device), so a Q4
MoE holds its file's bytes, not ~8x that in fp32. Small groups, the decode case, stream the
integers through linear_wq; a group larger than DROPPED_WQ_MAX_TOKENS (fused_moe_cpu.py) dequantizes its expert's projection
into one fp32 scratch buffer shared by every layer (DequantScratch) and runs the fp32 GEMM on it,
as a dense Linear's large batches run fp32 (layers/linear.py). The dequantization is exact (the
forms' own fp32 products), so results equal the old fp32 copy's bit for bit.
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


class DequantScratch:
    """One fp32 buffer that large expert groups dequantize their projection into, reused by every
    group of every layer (a forward runs one group at a time), grown to the largest projection
    asked for. Resident cost: one expert projection in fp32."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32)

    def dequantize(self, form: GroupQuantWeight) -> torch.Tensor:
        """form's fp32 weight [out, in], valid until the next call."""
        n, k = form.out_features, form.in_features
        if self._buffer.numel() < n * k or self._buffer.device != form.qweight.device:
            self._buffer = torch.empty(n * k, dtype=torch.float32, device=form.qweight.device)
        return form.dequantize(out=self._buffer[: n * k].view(n, k))

    def nbytes(self) -> int:
        return self._buffer.numel() * 4
