"""The routed experts of a compressed-tensors W8A8 int8 MoE checkpoint (llm-compressor's Qwen3-MoE /
Mixtral recipes): each expert's `experts.{e}.{gate,up,down}_proj.weight` int8 [N, K] with its
`weight_scale` [N, 1] goes into the layer's ExpertsInt8 as the checkpoint stores it, the int8
experts --quantization w8a8_int8 would make from fp32 ones (layers/moe/int8_experts.py).

quantized_hf.py loads the checkpoint's integers and scales through the model's own weight loaders
into the weight parameters (one pass each, NaN where a pass writes nothing); for a FusedMoE the
loader is FusedMoE.weight_loader, so every expert's integers land in its slot of w13_weight /
w2_weight, gate rows then up rows, this rank's slice only (tensor and expert parallelism). This
module marks the stacked weights before a pass and collects what it wrote after it; the fp32 pass
then loads the exact dequantization s * q. Nothing is requantized: a checkpoint whose rows do not
reach 127 (a clipping observer, or -128 at the negative end) keeps its integers and scales.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.moe.int8_experts import ExpertsInt8
from radixserve.layers.moe.layer import FusedMoE
from radixserve.model_loader.errors import ModelLoadError

# kind ("q" / "scale") -> (w13 plane, w2 plane) of one layer, None for a projection not quantized.
Planes = dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]


def expert_layers(model: nn.Module) -> dict[str, FusedMoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}


def mark_unwritten(layers: dict[str, FusedMoE]) -> None:
    """Fill the stacked expert weights with NaN: what a plane pass leaves NaN it did not write."""
    with torch.no_grad():
        for layer in layers.values():
            layer.w13_weight.fill_(float("nan"))
            layer.w2_weight.fill_(float("nan"))


def harvest(layers: dict[str, FusedMoE], kind: str, planes: dict[str, Planes]) -> None:
    """Record what the last pass wrote into each layer's stacked weights: q as int8 [E, N, K],
    a scale one value per output row [E, N]."""
    for name, layer in layers.items():
        w13 = _plane(f"{name}.w13_weight", layer.w13_weight.detach(), kind)
        w2 = _plane(f"{name}.w2_weight", layer.w2_weight.detach(), kind)
        if (w13 is None) != (w2 is None):
            which = "gate/up" if w13 is not None else "down"
            raise ModelLoadError(
                f"{name}: the checkpoint quantizes only the experts' {which} projections; radixserve "
                "serves a MoE layer's experts all int8 or all unquantized"
            )
        if w13 is not None:
            planes.setdefault(name, {})[kind] = (w13, w2)


def _plane(name: str, w: torch.Tensor, kind: str) -> torch.Tensor | None:
    missing = torch.isnan(w)  # [E, N, K]
    if bool(missing.all()):
        return None
    if bool(missing.any()):
        experts = sorted({int(e) for e in missing.flatten(1).any(1).nonzero().flatten()})
        raise ModelLoadError(
            f"{name}: the checkpoint quantizes only some experts' projections (local experts "
            f"{experts[:8]}{' ...' if len(experts) > 8 else ''} are not); radixserve needs all or none"
        )
    if kind == "q":
        return w.to(torch.int8)
    compact = w[:, :, 0].contiguous()  # [E, N]
    if not torch.equal(w, compact.unsqueeze(-1).expand_as(w)):
        raise ModelLoadError(f"{name}: the weight scales are not one per output channel")
    return compact


def attach(layers: dict[str, FusedMoE], planes: dict[str, Planes]) -> int:
    """Give every layer with quantized experts its ExpertsInt8 (checked to dequantize to the fp32
    weights the last pass loaded); returns how many layers got one."""
    for name, forms in planes.items():
        layer = layers[name]
        (q13, q2), (s13, s2) = forms["q"], forms["scale"]
        assert q13 is not None and q2 is not None and s13 is not None and s2 is not None
        layer.experts_int8 = ExpertsInt8(q13.contiguous(), s13, q2.contiguous(), s2)
        w13, w2 = layer.experts_int8.dequantize()
        if not (torch.equal(w13, layer.w13_weight.detach()) and torch.equal(w2, layer.w2_weight.detach())):
            raise ModelLoadError(
                f"{name}: the int8 experts do not dequantize to the loaded weights (a loader bug)"
            )
    return len(planes)
