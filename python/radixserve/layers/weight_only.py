"""On-the-fly weight-only quantization (SGLang's `--torchao-config int8wo` / `int4wo-<group>`) into
GroupQuantWeights.

- int8wo: int8, symmetric, one scale per output channel (group_size = in_features):
  scale = max|row| / 127, q = round(w * (127 / max|row|)) half to even (layers/quantization.py's
  quantizer, the one w8a8_int8 uses for its weights).
- int4wo-<g>: 4 bits, asymmetric, per group of g inputs: scale = (max - min) / 15,
  q = round((w - min) / scale) half to even, clamped to 0..15, offset = min, so that
  w ~= q * scale + min (a constant group gets scale 0 and is exactly its min). SGLang (torchao)
  takes g in 32, 64, 128, 256, and leaves a layer whose in_features g does not divide unquantized.

The quantized layer's fp32 weight is then replaced by the dequantization (dequantize()), so every
batch size computes with the same quantized model.
"""

from __future__ import annotations

import torch

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.layers.quantization import quantize_rows_int8

# SGLang's --torchao-config choices (its server_args help); only SUPPORTED ones are implemented.
TORCHAO_CONFIGS = ("int8dq", "int8wo", "int4wo-<group_size>", "fp8wo", "fp8dq-per_tensor", "fp8dq-per_row")
INT4WO_GROUP_SIZES = (32, 64, 128, 256)
SUPPORTED_TORCHAO = "int8wo, int4wo-32, int4wo-64, int4wo-128, int4wo-256"


def parse_torchao_config(config: str) -> tuple[int, int | None]:
    """(bits, group size; None: per channel) of a supported config; ValueError naming what is
    supported otherwise."""
    if config == "int8wo":
        return 8, None
    if config.startswith("int4wo-"):
        group = config.removeprefix("int4wo-")
        if group.isdigit() and int(group) in INT4WO_GROUP_SIZES:
            return 4, int(group)
        raise ValueError(
            f"--torchao-config {config}: the int4wo group size must be one of {INT4WO_GROUP_SIZES} "
            f"(SGLang's choices); supported here: {SUPPORTED_TORCHAO}"
        )
    known = config in TORCHAO_CONFIGS or config.startswith(("fp8dq-", "gemlite-"))
    what = "is not implemented by radixserve" if known else "is not a torchao config SGLang defines"
    raise ValueError(
        f"--torchao-config {config} {what}; supported: {SUPPORTED_TORCHAO} (docs/quantization.md)"
    )


def quantize_int8wo(weight: torch.Tensor) -> GroupQuantWeight:
    """int8, symmetric, per output channel: one group of all in_features."""
    q, scale = quantize_rows_int8(weight.detach())
    return GroupQuantWeight(q, scale.unsqueeze(1).contiguous(), None, weight.shape[1], 8)


def quantize_int8_groups(weight: torch.Tensor, group_size: int) -> GroupQuantWeight:
    """int8, symmetric, one scale per group of `group_size` inputs (GGUF Q8_0's layout at 32):
    each group quantized as quantize_rows_int8 quantizes a row."""
    n, k = weight.shape
    q, scale = quantize_rows_int8(weight.detach().reshape(n * (k // group_size), group_size))
    return GroupQuantWeight(q.reshape(n, k), scale.reshape(n, k // group_size), None, group_size, 8)


def quantize_int4wo(weight: torch.Tensor, group_size: int) -> GroupQuantWeight:
    """4-bit asymmetric per group of `group_size` inputs (module docstring)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    low = w.amin(dim=-1, keepdim=True)
    scale = (w.amax(dim=-1, keepdim=True) - low) / torch.full_like(low, 15.0)
    # Tensor by tensor division (IEEE-rounded); a constant group has scale 0 and q 0.
    steps = torch.where(scale > 0, (w - low) / torch.where(scale > 0, scale, 1.0), 0.0)
    q = torch.round(steps).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return GroupQuantWeight(
        pack_int4(q), scale.reshape(n, -1).contiguous(), low.reshape(n, -1).contiguous(), group_size, 4
    )


def quantize_weight_only(weight: torch.Tensor, bits: int, group_size: int | None) -> GroupQuantWeight | None:
    """The weight's wq form for a parsed --torchao-config, or None where the group size does not
    divide its in_features (torchao's rule: the layer stays unquantized)."""
    if bits == 8:
        if weight.shape[1] % 16:
            return None  # GroupQuantWeight's groups are multiples of 16 inputs
        return quantize_int8wo(weight)
    assert group_size is not None
    if weight.shape[1] % group_size:
        return None
    return quantize_int4wo(weight, group_size)
