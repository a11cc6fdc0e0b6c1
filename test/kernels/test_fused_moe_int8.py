"""The grouped MoE kernel with W8A8 int8 experts (--quantization w8a8_int8) against the
torch-native W8A8 reference (every expert over every token, each projection the torch W8A8
linear), and the int8 experts' error against the fp32 experts they were made from. Random shapes,
top-k 1 to 8, experts that get no tokens, groups from 1 to ~100 tokens, expert parallelism."""

import pytest
import torch

from radixserve.layers.moe.fused_moe_cpu import fused_experts_grouped
from radixserve.layers.moe.fused_moe_native import fused_experts_native, fused_experts_native_w8a8
from radixserve.layers.moe.int8_experts import ExpertsInt8
from radixserve.layers.moe.topk import select_experts

CASES = [
    # (num_tokens, num_experts, top_k, hidden, inter)
    (1, 8, 1, 64, 32),
    (1, 64, 8, 128, 48),  # decode: most experts idle
    (5, 16, 2, 96, 40),
    (37, 8, 2, 64, 24),
    (200, 4, 1, 48, 64),
]


def _case(case: tuple[int, ...], seed: int):
    num_tokens, num_experts, top_k, hidden, inter = case
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen) * 2, top_k, True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}" for c in CASES])
def test_int8_experts_match_the_native_w8a8_reference(case):
    x, w13, w2, weights, ids = _case(case, seed=sum(case))
    int8 = ExpertsInt8.quantize(w13, w2)
    got = fused_experts_grouped(x, w13, w2, weights, ids, int8=int8)
    ref = fused_experts_native_w8a8(x, int8, weights, ids)
    # Same int8 bytes on both sides (per-token activation quantization does not depend on the
    # grouping); the sums' order differs, which can move an intermediate activation across an
    # int8 rounding boundary (one step, 1/127 of its token's amax). Measured max |diff| <= 2.4e-6.
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    # The int8 experts are not the fp32 ones: the error against the fp32 experts they came from is
    # bounded by int8 rounding of weights and activations (measured on these cases: max |diff| /
    # max |ref| 1.3-2.5%, mean relative 1.6-2.3%), far from an unrelated result (~100%).
    fp32 = fused_experts_native(x, w13, w2, weights, ids)
    scale = fp32.abs().max()
    assert (got - fp32).abs().max() / scale < 0.05
    assert (got - fp32).abs().mean() / fp32.abs().mean() < 0.04


def test_int8_experts_are_the_rows_quantization():
    _, w13, w2, _, _ = _case((1, 4, 1, 64, 32), seed=0)
    int8 = ExpertsInt8.quantize(w13, w2)
    assert int8.w13.dtype == torch.int8 and int8.w13.shape == w13.shape
    assert int8.w13_scale.shape == w13.shape[:2] and int8.w2_scale.shape == w2.shape[:2]
    deq13, deq2 = int8.dequantize()
    # Per output channel: each row's error is at most half a step of its own scale.
    assert ((deq13 - w13).abs() <= int8.w13_scale.unsqueeze(-1) / 2 + 1e-7).all()
    assert ((deq2 - w2).abs() <= int8.w2_scale.unsqueeze(-1) / 2 + 1e-7).all()
    assert int8.w13.abs().amax(dim=-1).eq(127).all()  # every row uses the full range


def test_int8_experts_under_expert_parallelism():
    # A rank holding experts [4, 8) of 8: its part equals the reference restricted to them.
    x, w13, w2, weights, ids = _case((9, 8, 2, 64, 32), seed=3)
    local = ExpertsInt8.quantize(w13[4:], w2[4:])
    got = fused_experts_grouped(x, w13[4:], w2[4:], weights, ids, expert_start=4, int8=local)
    full = ExpertsInt8(
        *(torch.cat([torch.zeros_like(t), t]) for t in (local.w13, local.w13_scale, local.w2, local.w2_scale))
    )
    ref = fused_experts_native_w8a8(x, full, weights * (ids >= 4), ids)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
