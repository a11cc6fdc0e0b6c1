"""W8A8 int8 experts (--quantization w8a8_int8 on a MoE model): each local expert's gate/up and
down projections as int8 with one fp32 scale per output channel, the scheme the dense linears
use (layers/quantization.py). The grouped kernel runs each expert group through the same
`linear_w8a8` (sgl-kernel's int8 GEMM, activations quantized per token at run time) at every
group size, as a dense W8A8 linear runs at every batch size.

The fp32 stacked experts stay beside the int8 ones, as a dense W8A8 Linear's fp32 weight does:
weight updates and /get_weights_by_name read and write them, and the int8 forms are made again
from them (`quantize_experts`) whenever the derived forms are rebuilt. A compressed-tensors W8A8
checkpoint brings its own int8 experts instead (model_loader/quantized_experts.py: the file's
integers and scales, never requantized; updates of such a model are refused). The router is never
quantized (models/moe_decoder.py: routing stays the checkpoint's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.layers.quantization import INT8_KERNEL, dequantize_int8, quantize_rows_int8

logger = logging.getLogger(__name__)


def _quantize_stacked(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_experts, out, in] fp32 -> (int8 [num_experts, out, in], fp32 scales [num_experts, out])."""
    num_experts, out, inp = weight.shape
    q, scale = quantize_rows_int8(weight.detach().reshape(num_experts * out, inp))
    return q.view(num_experts, out, inp), scale.view(num_experts, out)


@dataclass(frozen=True)
class ExpertsInt8:
    """w13 int8 [num_local, 2 * inter, hidden] with w13_scale [num_local, 2 * inter]; w2 int8
    [num_local, hidden, inter] with w2_scale [num_local, hidden] (FusedMoE's layout)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @classmethod
    def quantize(cls, w13: torch.Tensor, w2: torch.Tensor) -> ExpertsInt8:
        return cls(*_quantize_stacked(w13), *_quantize_stacked(w2))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (w13, w2) as the int8 forms give them (the reference's weights)."""
        return (
            dequantize_int8(self.w13.flatten(0, 1), self.w13_scale.flatten()).view(self.w13.shape),
            dequantize_int8(self.w2.flatten(0, 1), self.w2_scale.flatten()).view(self.w2.shape),
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w13_scale, self.w2, self.w2_scale))


def quantize_experts(modules: list[nn.Module]) -> None:
    """--quantization w8a8_int8: give every fp32 CPU FusedMoE in `modules` int8 experts made from
    its fp32 ones (again on every call: the fp32 experts may have changed). Logs what it did."""
    from radixserve.layers.moe.layer import FusedMoE  # layer.py imports this module

    layers = [m for root in modules for m in root.modules() if isinstance(m, FusedMoE)]
    layers = [m for m in layers if m.w13_weight.dtype == torch.float32 and m.w13_weight.device.type == "cpu"]
    for layer in layers:
        layer.experts_int8 = ExpertsInt8.quantize(layer.w13_weight, layer.w2_weight)
    if layers:
        int8_bytes = sum(layer.experts_int8.nbytes() for layer in layers)
        logger.info(
            "w8a8_int8: %d MoE layers' experts quantized to int8 (%.0f MiB with scales), run by %s; "
            "the fp32 experts stay for weight updates and reads",
            len(layers),
            int8_bytes / 2**20,
            "sgl-kernel's linear_int8"
            if INT8_KERNEL
            else "the torch reference (sgl-kernel's linear_int8 not built)",
        )
