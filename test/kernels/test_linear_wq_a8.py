"""sgl-kernel's linear_wq_a8 (weight-only quantized linear with int8 activations per 32 inputs,
--cpu-wq-int8-activations) on each of its code paths against
radixserve.layers.group_quant.linear_wq_a8_reference (x quantized and dequantized per block, the
weight dequantized, an fp32 matmul); the activation bytes themselves; its refusals; and the MoE
experts that run it (fused_experts_grouped with marked forms, experts that get no tokens too)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_linear_wq import _weight  # the same random group-quantized weights

from radixserve.layers import cpu_crossovers, group_quant
from radixserve.layers.group_quant import (
    A8_MAX_ROWS,
    GroupQuantWeight,
    linear_wq_a8_reference,
    linear_wq_reference,
    quantize_act_blocks,
)
from radixserve.layers.moe.fused_moe_cpu import fused_experts_grouped
from radixserve.layers.moe.quantized import ExpertsWq
from radixserve.layers.moe.topk import select_experts
from sgl_kernel import cpu as cpu_kernels

ISAS = cpu_kernels.linear_wq_a8_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="sgl_kernel._cpu built without linear_wq_a8 (or not built)")
# Why a path is missing: "avx512" is AVX-512 VNNI (vpdpbusd), built only where -march=native has
# AVX512_VNNI and AVX512VL (Zen 4 and later, Ice Lake and later), not on AVX2-only machines.
_MISSING = {
    "avx2": "avx2 path not compiled here (the build machine has no AVX2/FMA/F16C)",
    "avx512": "avx512 (VNNI) path not compiled here: the build machine lacks AVX512_VNNI/AVX512VL",
}


def isa_params(isas: tuple[str, ...]) -> list:
    """pytest params over `isas`, each skipped (with the reason printed) where not compiled here."""
    return [
        pytest.param(isa, marks=pytest.mark.skipif(isa not in ISAS, reason=_MISSING.get(isa, "")))
        for isa in isas
    ]


ALL_ISAS = isa_params(("scalar", "avx2", "avx512"))
# The VNNI path against the AVX2 one, where both are built (the same integer sums: the same bits).
VNNI = pytest.mark.skipif(
    not {"avx2", "avx512"} <= set(ISAS), reason=_MISSING["avx512"] if "avx2" in ISAS else _MISSING["avx2"]
)


@pytest.fixture(autouse=True)
def _a8_bound() -> Iterator[None]:
    """Marked forms take int8 activations up to A8_MAX_ROWS rows here (what
    --cpu-wq-int8-activations installs where nothing was measured); the process's crossovers are
    restored afterwards."""
    before = cpu_crossovers.active()
    cpu_crossovers.install(cpu_crossovers.Crossovers(wq_a8_max_tokens=A8_MAX_ROWS))
    yield
    cpu_crossovers.install(before)


def _check(got: torch.Tensor, x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None) -> None:
    """got == the reference up to fp32 rounding: the block dot products are exact integers on
    both sides; what differs is the order and rounding of the per-block scaled sums, each moving
    the result by at most 2^-24 of the magnitudes added (`mag`). 64 ulps of mag is far below what
    one wrong nibble, activation byte or scale costs (>= ~1/K of mag)."""
    ref = linear_wq_a8_reference(x, w, bias)
    qs = w.integers().float() * w.scales.repeat_interleave(w.group_size, dim=1)
    terms = qs.abs() + (0 if w.offsets is None else w.offsets.abs().repeat_interleave(w.group_size, dim=1))
    mag = quantize_act_blocks(x).abs() @ terms.T
    tol = 64 * 2.0**-24 * mag + 1e-30
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = (got - ref).abs()
    assert torch.all(err <= tol), (
        f"max err {float(err.max()):.3g}, worst ratio {float((err / tol).max()):.3g}"
    )


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offsets", [False, True], ids=["sym", "offsets"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_matches_the_reference(isa: str, bits: int, offsets: bool, group: int, m: int) -> None:
    n, k = 37, 256  # 37: 4-row tiles and the single-row rest
    w = _weight(n, k, bits, group, offsets, seed=bits + group + m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k // 32, 1, generator=gen).repeat(1, 1, 32).view(
        m, k
    )
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by zero
    bias = torch.randn(n, generator=gen) if m % 2 else None
    got = cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, w.offsets, bits, group, bias, isa=isa)
    _check(got, x, w, bias)


@VNNI
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offsets", [False, True], ids=["sym", "offsets"])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_vnni_gives_the_avx2_bits(bits: int, offsets: bool, m: int) -> None:
    """vpdpbusd's int32 lanes are vpmaddubsw + vpmaddwd's (int8: w + 128 and the lane's
    -128 * sum(x) correction), and the fp32 epilogue is shared: equal bit for bit."""
    n, k = 37, 320
    w = _weight(n, k, bits, 64, offsets, seed=11 + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 4
    bias = torch.randn(n) if m % 2 else None
    args = (x, w.qweight, w.scales, w.offsets, bits, 64, bias)
    got = cpu_kernels.linear_wq_a8(*args, isa="avx512")
    assert torch.equal(got, cpu_kernels.linear_wq_a8(*args, isa="avx2"))
    _check(got, x, w, bias)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_int8_weight_extremes(isa: str) -> None:
    """Weights -128 and 127 against x at -127 and +127: |w| = 128 (AVX2's sign trick), w + 128 at
    0 and 255 (VNNI's unsigned weights) and the largest corrections, all exact integers."""
    n, k = 4, 64
    q = torch.tensor([-128, 127, -128, 127], dtype=torch.int8).view(n, 1).expand(n, k).contiguous()
    q[2, ::2] = 127  # a row mixing both extremes
    w = GroupQuantWeight(q, torch.ones(n, k // 32), None, 32, 8)
    x = torch.full((2, k), 127.0)  # activation scale exactly 1
    x[1, 1::2] = -127.0
    got = cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, None, 8, 32, isa=isa)
    assert torch.equal(got, x @ q.float().T)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_activation_bytes_match_the_reference_quantization(isa: str) -> None:
    """An identity int8 weight (scale 1) returns each input's dequantized byte: one product per
    output, so any rounding or scale difference from quantize_act_blocks shows exactly."""
    k = 96
    w = GroupQuantWeight(torch.eye(k, dtype=torch.int8), torch.ones(k, k // 32), None, 32, 8)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5)) * 3
    got = cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, None, 8, 32, isa=isa)
    assert torch.equal(got, quantize_act_blocks(x))


def test_strided_rows_and_int4_even_odd_order() -> None:
    """x a view with a row stride (as a slice of a larger batch is), int4 weights whose every
    nibble differs: a mix-up of the block's even / odd inputs would show."""
    w = _weight(16, 64, 4, 32, offsets=True, seed=3)
    big = torch.randn(4, 80, generator=torch.Generator().manual_seed(4))
    x = big[:, 8:72]
    got = cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, w.offsets, 4, 32)
    _check(got, x.contiguous(), w, None)


def test_refusals() -> None:
    w = _weight(8, 64, 8, 32, offsets=False)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.linear_wq_a8(x, w.qweight, w.scales.repeat(1, 2), None, 8, 16)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.linear_wq_a8(x.double(), w.qweight, w.scales, None, 8, 32)
    with pytest.raises(ValueError, match="isa"):
        cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, None, 8, 32, isa="avx10")
    with pytest.raises(ValueError, match="multiple of 32"):
        GroupQuantWeight(w.qweight, w.scales.repeat(1, 2), None, 16, 8, int8_activations=True)


def test_linear_wq_routes_marked_forms_to_the_int8_activation_kernel() -> None:
    w = _weight(24, 128, 4, 32, offsets=True, seed=7)
    marked = dataclasses.replace(w, int8_activations=True)
    x = torch.randn(A8_MAX_ROWS + 1, 128, generator=torch.Generator().manual_seed(8))
    small = x[:A8_MAX_ROWS]
    _check(group_quant.linear_wq(small, marked), small, w, None)
    # Unmarked: the fp32-activation product, which the int8 one is not.
    unmarked = group_quant.linear_wq(small, w)
    assert not torch.allclose(unmarked, group_quant.linear_wq(small, marked), rtol=0, atol=1e-7)
    # More rows than A8_MAX_ROWS: fp32 activations, marked or not.
    assert torch.equal(group_quant.linear_wq(x, marked), group_quant.linear_wq(x, w))


def _a8_moe_reference(
    x: torch.Tensor, wq: ExpertsWq, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Token by token, each of its experts through the int8-activation reference where the
    expert's group has at most A8_MAX_ROWS tokens, else the fp32 one (linear_wq's routing)."""
    out = torch.zeros_like(x)
    counts = torch.bincount(topk_ids.flatten(), minlength=len(wq.w13)).tolist()
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            ref = linear_wq_a8_reference if counts[e] <= A8_MAX_ROWS else linear_wq_reference
            gate, up = ref(x[t : t + 1], wq.w13[e]).chunk(2, dim=-1)
            out[t] += w * ref(F.silu(gate) * up, wq.w2[e])[0]
    return out


@pytest.mark.parametrize(
    "case", [(1, 16, 8), (5, 32, 2), (12, 8, 3)], ids=["T1-E16-k8", "T5-E32-k2", "T12-E8-k3"]
)
def test_moe_experts_with_int8_activations(case: tuple[int, int, int]) -> None:
    num_tokens, num_experts, top_k = case
    hidden, inter = 64, 32
    forms = [
        (_weight(2 * inter, hidden, 4, 32, True, seed=e), _weight(hidden, inter, 8, 32, False, seed=100 + e))
        for e in range(num_experts)
    ]
    mark = lambda f: dataclasses.replace(f, int8_activations=True)  # noqa: E731
    wq = ExpertsWq(tuple(mark(a) for a, _ in forms), tuple(mark(b) for _, b in forms))
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen) * 2, top_k, True)
    meta13 = torch.empty(num_experts, 2 * inter, hidden, device="meta")
    meta2 = torch.empty(num_experts, hidden, inter, device="meta")
    got = fused_experts_grouped(x, meta13, meta2, weights, ids, None, wq)
    ref = _a8_moe_reference(x, wq, weights, ids)
    # The silu-mul between the projections is computed by different code on each side: a last-bit
    # difference may move one activation byte of the down projection by one step (~1/127 of its
    # block's largest input, times a weight), far below a wrong expert or weight (O(1) of out).
    assert torch.allclose(got, ref, rtol=1e-3, atol=2e-3 * float(ref.abs().max())), float(
        (got - ref).abs().max()
    )
