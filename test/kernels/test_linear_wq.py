"""sgl-kernel's linear_wq (weight-only group-quantized linear) on each of its code paths (scalar,
AVX2, AVX-512: an AVX-512 machine runs the AVX2 path too, forced by `isa`) against
radixserve.layers.group_quant.linear_wq_reference (dequantize, then an fp32 matmul), and its
refusal of malformed inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from wq_weights import random_wq_weight as _weight  # also imported from here by the wq_a8 tests

from radixserve.layers.group_quant import GroupQuantWeight, linear_wq_reference
from sgl_kernel import cpu as cpu_kernels

ISAS = cpu_kernels.linear_wq_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="sgl_kernel._cpu built without linear_wq (or not built)")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()[2:]}


def _isa_param(isa: str) -> object:
    return pytest.param(
        isa, marks=pytest.mark.skipif(isa not in ISAS, reason=f"{isa} path not compiled here")
    )


ALL_ISAS = [_isa_param(isa) for isa in ("scalar", "avx2", "avx512")]


def _check(got: torch.Tensor, x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None) -> None:
    """got == the reference up to rounding. Both sides add the same K products x_k * w_k in fp32,
    in different orders (the kernel in 8- or 16-lane accumulators and a final lane sum, the
    reference as oneDNN/MKL blocks it), and the kernel makes each weight as fma(q, s, o) (one
    rounding) where the reference rounds q * s and then + o. Each of those roundings moves the sum
    by at most 2^-24 of the magnitudes it adds, so the error is bounded by a multiple of
    sum_k |x_k| (|q_k s| + |o|) (`mag`): 64 ulps of it is far above the measured worst (~4.4 ulps
    here, K up to 1536) and far below what one wrong nibble, scale or group (~1/K of mag, >= 1e-4 of it) costs."""
    ref = linear_wq_reference(x, w, bias)
    qs = w.integers().float() * w.scales.repeat_interleave(w.group_size, dim=1)
    terms = qs.abs() + (0 if w.offsets is None else w.offsets.abs().repeat_interleave(w.group_size, dim=1))
    mag = x.abs() @ terms.T
    tol = 64 * 2.0**-24 * mag + 1e-30
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = (got - ref).abs()
    assert torch.all(err <= tol), (
        f"max err {float(err.max()):.3g}, worst ratio {float((err / tol).max()):.3g}"
    )


def test_both_vector_paths_are_built_where_the_cpu_has_them():
    flags = _cpu_flags()
    assert "scalar" in ISAS
    if {"avx2", "fma", "f16c"} <= flags:
        assert "avx2" in ISAS
    if "avx512f" in flags:
        assert "avx512" in ISAS


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 128, 256])  # 256 = K: one group per row
@pytest.mark.parametrize("offsets", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_the_reference_for_every_batch_size(isa, bits, group, offsets, bias):
    n, k = 37, 256  # odd N: full 8- and 4-row tiles and single rows
    w = _weight(n, k, bits, group, offsets)
    gen = torch.Generator().manual_seed(1)
    b = torch.randn(n, generator=gen) if bias else None
    for m in range(1, 18):
        x = torch.randn(m, k, generator=gen)
        got = cpu_kernels.linear_wq(x, w.qweight, w.scales, w.offsets, bits, group, b, isa=isa)
        _check(got, x, w, b)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "group"), [(80, 16), (80, 80), (272, 16), (48, 48), (16, 16)])
def test_k_an_odd_multiple_of_16(isa, bits, k, group):
    """K % 32 == 16: the AVX-512 int4 path's last 16 inputs take the scalar tail, and a group of
    16 (or 48, 80) splits its 32-input blocks at the middle."""
    w = _weight(9, k, bits, group, offsets=True, seed=k)
    for m in (1, 3, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = cpu_kernels.linear_wq(x, w.qweight, w.scales, w.offsets, bits, group, isa=isa)
        _check(got, x, w, None)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize(
    ("n", "k", "bits", "group", "offsets"),
    [
        (960, 576, 4, 32, True),  # the built-in model's fused qkv as Q4_1
        (576, 1536, 8, 32, False),  # its down_proj as Q8_0
        (576, 576, 8, 16, False),  # o_proj as Q6_K (int8, groups of 16)
        (3072, 576, 8, 576, False),  # gate_up as int8 per channel
        (576, 1536, 4, 128, True),  # down_proj as GPTQ / AWQ int4
    ],
)
def test_model_shapes(isa, n, k, bits, group, offsets):
    w = _weight(n, k, bits, group, offsets)
    for m in (1, 4, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        _check(cpu_kernels.linear_wq(x, w.qweight, w.scales, w.offsets, bits, group, isa=isa), x, w, None)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize(("bits", "offsets"), [(4, True), (8, False)])  # Q4_1, Q8_0
def test_each_row_is_the_same_at_every_batch_size(isa, bits, offsets):
    """Row m of an M-row call is bit-identical to that row alone, for every M and tile shape
    (1 x 8, 2 x 8, 4 x 4, 8 x 2 on AVX-512; 2 x 4 and 1-8 x 1 on AVX2): a speculative verify step's rows then get the logits plain
    decoding would, which is what keeps greedy speculation token-identical to plain decoding."""
    w = _weight(37, 256, bits, 32, offsets)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(3))
    alone = torch.cat(
        [
            cpu_kernels.linear_wq(x[i : i + 1], w.qweight, w.scales, w.offsets, bits, 32, isa=isa)
            for i in range(17)
        ]
    )
    for m in range(1, 18):
        got = cpu_kernels.linear_wq(x[:m], w.qweight, w.scales, w.offsets, bits, 32, isa=isa)
        assert torch.equal(got, alone[:m]), f"M={m}: rows differ from the same rows alone"


def test_rows_of_a_wider_tensor_and_empty_batches():
    w = _weight(11, 64, 4, 32, offsets=True)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # rows contiguous, stride 100
    _check(cpu_kernels.linear_wq(x, w.qweight, w.scales, w.offsets, 4, 32), x, w, None)
    empty = cpu_kernels.linear_wq(torch.empty(0, 64), w.qweight, w.scales, w.offsets, 4, 32)
    assert empty.shape == (0, 11)


def test_auto_picks_a_path_with_the_same_answer():
    w = _weight(40, 128, 4, 32, offsets=True)
    x = torch.randn(3, 128)
    _check(cpu_kernels.linear_wq(x, w.qweight, w.scales, w.offsets, 4, 32), x, w, None)


def _args(**changes: object) -> dict:
    w = _weight(8, 64, 4, 32, offsets=True)
    args = {
        "x": torch.randn(2, 64),
        "qweight": w.qweight,
        "scales": w.scales,
        "offsets": w.offsets,
        "bits": 4,
        "group_size": 32,
        "bias": torch.zeros(8),
    }
    return {**args, **changes}


_w8 = _weight(8, 64, 8, 32, offsets=False)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"x": torch.randn(2, 64, dtype=torch.float64)}, "x must be float32"),
        ({"x": torch.randn(64, 2).T}, "contiguous rows"),
        ({"x": torch.randn(2, 3, 64)}, r"x must be float32 \[M, K\]"),
        ({"x": torch.randn(2, 96)}, "x has K=96"),
        ({"qweight": _w8.qweight}, "4-bit qweight must be a contiguous uint8"),
        ({"bits": 8}, "8-bit qweight must be a contiguous int8"),
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"qweight": torch.zeros(16, 64, dtype=torch.uint8)[::2]}, "4-bit qweight must be a contiguous"),
        ({"scales": torch.ones(8, 2, dtype=torch.bfloat16)}, "scales must be a contiguous float32"),
        # fp16 scales take fp16 offsets (test_linear_wq_half_groups.py), and fp32 ones fp32.
        ({"scales": torch.ones(8, 2, dtype=torch.float16)}, "offsets must be a contiguous float16"),
        ({"offsets": torch.ones(8, 2, dtype=torch.float16)}, "offsets must be a contiguous float32"),
        ({"scales": torch.ones(2, 8).T}, "scales must be a contiguous float32"),
        ({"scales": torch.ones(8, 4)}, r"scales must be a contiguous float32 \[8, 2\]"),
        ({"offsets": torch.ones(7, 2)}, r"offsets must be a contiguous float32 \[8, 2\]"),
        ({"group_size": 24}, "group_size 24 must be a multiple of 16"),
        ({"group_size": 48}, "group_size 48 must be a multiple of 16 dividing K=64"),
        ({"bias": torch.zeros(9)}, "bias must be a contiguous float32"),
        ({"bias": torch.zeros(8, dtype=torch.float64)}, "bias must be a contiguous float32"),
    ],
)
def test_malformed_inputs_are_refused(changes, message):
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.linear_wq(**_args(**changes))


def test_unknown_isa_and_a_kernel_form_are_refused():
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_kernels.linear_wq(**_args(), isa="avx1024")
    with pytest.raises(ValueError, match="kernel_form"):
        cpu_kernels.linear_wq(**_args(), kernel_form=torch.zeros(1))
