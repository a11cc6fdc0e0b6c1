"""W8A8 int8: the quantizers, sgl-kernel's linear_int8 on each of its code paths (scalar, AVX2,
AVX-512 VNNI: an AVX-512 machine runs the AVX2 path too, forced by `isa`) against the torch
reference (dequantize, then an fp32 matmul), and the fallback when the kernel is absent."""

import pytest
import torch

from radixserve.layers import quantization
from radixserve.layers.quantization import (
    dequantize_int8,
    linear_w8a8,
    linear_w8a8_reference,
    quantize_rows_int8,
    quantize_weight_int8,
)
from sgl_kernel import cpu as cpu_kernels

ISAS = cpu_kernels.linear_int8_isas()
needs_int8 = pytest.mark.skipif(not ISAS, reason="sgl_kernel._cpu built without linear_int8 (or not built)")


def _isa_param(isa: str) -> object:
    return pytest.param(
        isa, marks=pytest.mark.skipif(isa not in ISAS, reason=f"{isa} path not compiled here")
    )


ALL_ISAS = [_isa_param(isa) for isa in ("scalar", "avx2", "avx512")]


def _exact_w8a8(
    x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The same arithmetic as the kernel with exact integer sums (float64 holds them exactly)."""
    xq, xs = quantize_rows_int8(x)
    dot = (xq.double() @ wq.double().T).float()
    out = dot * (xs.unsqueeze(1) * ws.unsqueeze(0))
    return out if bias is None else out + bias


def _case(m: int, k: int, n: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, : min(k, 5)] = 0.0  # zeros quantize to 0 exactly
    w = torch.randn(n, k, generator=gen) * 0.05
    wq, ws = quantize_weight_int8(w)
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, wq, ws, b


# ------------------------------------------------------------------ quantize / dequantize
def test_weight_quantization_round_trip_is_within_half_a_step():
    w = torch.randn(37, 100) * torch.logspace(-3, 1, 37).unsqueeze(1)  # rows of very different ranges
    w[5] = 0.0
    wq, ws = quantize_weight_int8(w)
    assert wq.dtype == torch.int8 and ws.dtype == torch.float32 and ws.shape == (37,)
    assert int(wq.abs().max()) == 127 and int(wq.min()) >= -127
    err = (dequantize_int8(wq, ws) - w).abs()
    # Round to nearest: at most half a step (plus fp32 rounding of the scaled values).
    assert torch.all(err <= ws.unsqueeze(1) * (0.5 + 1e-5))
    assert ws[5] == 0 and torch.all(wq[5] == 0)
    # Each row's largest magnitude maps to +-127 exactly and comes back exactly.
    rows = torch.arange(37)
    top = w.abs().argmax(dim=1)
    torch.testing.assert_close(dequantize_int8(wq, ws)[rows, top], w[rows, top], rtol=1e-6, atol=0)


def test_values_on_the_grid_survive_quantization_exactly():
    scale = torch.tensor([0.5, 2.0])
    q = torch.randint(-127, 128, (2, 64), dtype=torch.int8)
    q[:, 0] = 127  # the row maximum fixes the scale
    wq, ws = quantize_weight_int8(dequantize_int8(q, scale))
    assert torch.equal(wq, q) and torch.equal(ws, scale)


def test_activation_quantization_rounds_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]])  # scale exactly 1
    q, s = quantize_rows_int8(x)
    assert s.tolist() == [1.0] and q.tolist() == [[127, 0, 2, 2, 0, -2]]


# ------------------------------------------------------------------ kernel vs reference
@needs_int8
@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 33])
@pytest.mark.parametrize(
    "k,n",
    [(576, 200), (64, 96), (100, 13), (1536, 96), (31, 9)],  # K with and without vector tails
)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_reference(isa, m, k, n, bias):
    x, _, wq, ws, b = _case(m, k, n, bias, seed=m * 1000 + k + n)
    got = cpu_kernels.linear_int8(x, wq, ws, b, isa=isa)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # Exact integer sums, one fp32 epilogue: only the scale product's rounding can differ.
    torch.testing.assert_close(got, _exact_w8a8(x, wq, ws, b), rtol=1e-6, atol=1e-6)
    # The dequantize-then-fp32 reference sums in fp32, so it is off by summation rounding only.
    torch.testing.assert_close(got, linear_w8a8_reference(x, wq, ws, b), rtol=1e-4, atol=1e-4)


@needs_int8
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_every_path_gives_the_same_bits(m):
    x, _, wq, ws, b = _case(m, 1000, 150, True, seed=7)
    outs = {isa: cpu_kernels.linear_int8(x, wq, ws, b, isa=isa) for isa in ISAS}
    for isa, out in outs.items():
        assert torch.equal(out, outs["scalar"]), isa


@needs_int8
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_kernel_quantizes_activations_to_the_reference_bytes(isa):
    # An identity weight with scale 1 returns each quantized activation times its row scale.
    k = 200
    x = torch.randn(3, k) * torch.tensor([[0.01], [1.0], [300.0]])
    eye = torch.eye(k, dtype=torch.int8)
    got = cpu_kernels.linear_int8(x, eye, torch.ones(k), isa=isa)
    xq, xs = quantize_rows_int8(x)
    assert torch.equal(got, xq.float() * xs.unsqueeze(1))


@needs_int8
@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("sign", [1, -1])
def test_extreme_values_do_not_saturate(isa, sign):
    # Every product 127 * 127: the AVX2 pairs reach 2 * 127 * 127 (int16 holds it), the VNNI path's
    # unsigned weights 254 * 127; the int32 sums stay exact.
    k = 4096 + 40
    x = torch.full((2, k), 3.0)
    wq = torch.full((9, k), 127 * sign, dtype=torch.int8)
    ws = torch.full((9,), 1.0 / 127)
    got = cpu_kernels.linear_int8(x, wq, ws, isa=isa)
    expected = torch.full((2, 9), sign * k * 127 * 127 * (3.0 / 127) / 127)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


@needs_int8
def test_kernel_takes_strided_rows_and_refuses_bad_inputs():
    x, _, wq, ws, _ = _case(4, 128, 24, False)
    wide = torch.zeros(4, 300)
    wide[:, 10:138] = x
    view = wide[:, 10:138]  # rows 300 floats apart
    assert torch.equal(cpu_kernels.linear_int8(view, wq, ws), cpu_kernels.linear_int8(x, wq, ws))
    with pytest.raises(RuntimeError, match="int8"):
        cpu_kernels.linear_int8(x, wq.float(), ws)
    with pytest.raises(RuntimeError, match="K="):
        cpu_kernels.linear_int8(x[:, :64], wq, ws)
    with pytest.raises(RuntimeError, match="w_scale"):
        cpu_kernels.linear_int8(x, wq, ws[:5])
    with pytest.raises(ValueError, match="isa"):
        cpu_kernels.linear_int8(x, wq, ws, isa="neon")


def test_without_the_kernel_the_reference_runs(monkeypatch):
    x, w, wq, ws, b = _case(3, 96, 40, True)
    monkeypatch.setattr(quantization, "INT8_KERNEL", False)
    got = linear_w8a8(x, wq, ws, b)
    assert torch.equal(got, linear_w8a8_reference(x, wq, ws, b))
    # And W8A8 is close to the fp32 linear it replaces (per-token and per-channel steps of 1/254
    # of the range, over K=96 random products).
    torch.testing.assert_close(got, x @ w.T + b, rtol=0.05, atol=0.05)
    # A 3-D input (what the module forward may pass) goes through the reference too.
    torch.testing.assert_close(linear_w8a8(x.unsqueeze(0), wq, ws, b)[0], got)
