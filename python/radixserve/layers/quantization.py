"""W8A8 int8 (--quantization w8a8_int8): the quantizers and the torch reference linear.

Weights: int8 with one fp32 scale per output channel (row), symmetric: scale = amax(row) / 127 and
q = round(w * (127 / amax)), so row n of the real weight is about q[n] * scale[n]. Activations:
the same per token (per row of x), at run time. The product is summed in int32 and scaled once:
y = (q_x @ q_w.T) * scale_x * scale_w (+ bias).

sgl-kernel's `linear_int8` computes that with int8 dot products (AVX-512 VNNI or AVX2); the torch
path here (dequantize, then an fp32 matmul) is the reference it is tested against and the path
used where the extension is not built. Both round half to even with the same fp32 operations, so
they quantize activations to the same bytes and differ only in summation rounding.
"""

from __future__ import annotations

import torch

from radixserve.layers import cpu_fused
from radixserve.layers.cpu_fused import cpu_kernels

INT8_MAX = 127
# sgl-kernel's linear_int8 is built (and enabled): decided once, like cpu_fused.ENABLED. An
# sgl-kernel from before it existed leaves this False and the torch reference runs.
INT8_KERNEL = cpu_fused.ENABLED and bool(getattr(cpu_kernels, "linear_int8_isas", list)())


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row of a 2-D fp32 tensor: (q int8 [M, K], scale fp32 [M]).
    An all-zero row gets scale 0 and q 0."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)  # [M, 1]
    # Tensor by tensor divisions: IEEE-rounded as the kernel's (a Python scalar numerator or
    # divisor may become a multiplication by a reciprocal, one rounding off).
    limit = torch.full_like(amax, INT8_MAX)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), (amax / limit).squeeze(1).contiguous()


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [out, in] (any float dtype) as int8 [out, in] and per-output-channel scales
    fp32 [out]."""
    return quantize_rows_int8(weight.detach())


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [M, K] with row scales [M] -> fp32 [M, K]."""
    return q.float() * scale.unsqueeze(1)


def linear_w8a8_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference W8A8 linear: quantize x per token, dequantize both sides, fp32 matmul.
    x [..., K] fp32, weight int8 [N, K], weight_scale fp32 [N] -> [..., N] fp32."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quantize_rows_int8(rows)
    out = dequantize_int8(q, scale) @ dequantize_int8(weight, weight_scale).T
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def linear_w8a8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8 linear through sgl-kernel's int8 kernel when it can take x (a 2-D fp32 CPU tensor with
    contiguous rows), else the torch reference."""
    kernel_ok = x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1
    if kernel_ok and INT8_KERNEL:
        return cpu_kernels.linear_int8(x, weight, weight_scale, bias)
    return linear_w8a8_reference(x, weight, weight_scale, bias)
