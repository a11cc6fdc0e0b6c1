"""The torch-native MoE reference every expert kernel is tested against: each expert runs densely
over every token and a mask of routing weights keeps the tokens routed to it. O(num_experts x
num_tokens) work, in fp32 whatever the weights' dtype: obviously right, never fast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.layers.moe.int8_experts import ExpertsInt8
from radixserve.layers.quantization import linear_w8a8_reference


def fused_experts_native(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum over each token's k experts of weight * down(silu(gate(x)) * up(x)).

    hidden [num_tokens, hidden_size]; w13 [num_experts, 2 * inter, hidden_size] (gate rows, then
    up rows); w2 [num_experts, hidden_size, inter]; topk_weights / topk_ids [num_tokens, top_k].
    Returns [num_tokens, hidden_size] in hidden's dtype."""
    x = hidden.float()
    out = torch.zeros_like(x)  # [num_tokens, hidden_size]
    for e in range(w13.shape[0]):
        # [num_tokens]: the token's routing weight for expert e, 0 where e is not among its top-k.
        mask = (topk_weights.float() * (topk_ids == e)).sum(dim=-1)
        gate, up = (x @ w13[e].float().T).chunk(2, dim=-1)  # [num_tokens, inter] each
        out += mask.unsqueeze(1) * ((F.silu(gate) * up) @ w2[e].float().T)
    return out.to(hidden.dtype)


def fused_experts_native_w8a8(
    hidden: torch.Tensor,
    int8: ExpertsInt8,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The W8A8 experts' reference: as fused_experts_native, each projection the torch W8A8
    reference linear (x quantized per token, both sides dequantized, fp32 matmul). Quantization
    is per token, so running every expert over every token quantizes each token as the grouped
    kernel does; only the sums' order differs. hidden fp32."""
    out = torch.zeros_like(hidden)  # [num_tokens, hidden_size]
    for e in range(int8.w13.shape[0]):
        mask = (topk_weights.float() * (topk_ids == e)).sum(dim=-1)  # [num_tokens]
        gate_up = linear_w8a8_reference(hidden, int8.w13[e], int8.w13_scale[e])  # [num_tokens, 2 * inter]
        gate, up = gate_up.chunk(2, dim=-1)
        out += mask.unsqueeze(1) * linear_w8a8_reference(F.silu(gate) * up, int8.w2[e], int8.w2_scale[e])
    return out
