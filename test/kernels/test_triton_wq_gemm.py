"""The Triton weight-only dequant-GEMM (sgl_kernel/triton/wq_gemm.py, linear_wq's CUDA path) vs the
dequantize-then-fp32-matmul reference (linear_wq_reference), on small shapes.

Without a CUDA device the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set here
before triton is imported). Tolerances, relative to the output's largest magnitude: fp32 1e-5
(only the summation order differs, K <= 512); fp16 2e-3 (each dequantized weight is rounded to
fp16, 2^-11 relative, plus the fp16 output); bf16 1e-2 (the output rounded to bf16, 2^-8; the
interpreter truncates where a GPU rounds, up to twice that: the dot itself runs in fp32 there).
"""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from radixserve.layers.group_quant import (  # noqa: E402
    GroupQuantWeight,
    linear_wq,
    linear_wq_reference,
    pack_int4,
    triton_wq_gemm,
)
from sgl_kernel.triton.wq_gemm import wq_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def random_weight(n: int, k: int, bits: int, group: int, offsets: bool, seed: int) -> GroupQuantWeight:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    else:
        qweight = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.05 + 0.001
    offs = torch.randn(n, k // group, generator=gen) * 0.1 if offsets else None
    return GroupQuantWeight(qweight, scales, offs, group, bits)


def run(x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    dev = torch.device(DEVICE)
    offsets = None if w.offsets is None else w.offsets.to(dev)
    bias_d = None if bias is None else bias.to(dev)
    return wq_gemm(
        x.to(dev), w.qweight.to(dev), w.scales.to(dev), offsets, w.bits, w.group_size, bias_d
    ).cpu()


def check(got: torch.Tensor, x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None) -> None:
    ref = linear_wq_reference(x.float(), w, None if bias is None else bias.float())
    assert got.dtype == x.dtype and got.shape == ref.shape
    err = (got.float() - ref).abs().max() / ref.abs().max()
    assert err <= TOL[x.dtype], f"relative error {err:.3g}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("group", [32, 128, 256])  # 256 = K: one group per row
def test_matches_reference(bits, offsets, group):
    # Odd N (a partial output tile); M 1 (decode), 5 and 33 (three 16-row tiles, the last partial).
    k, n = 256, 37
    w = random_weight(n, k, bits, group, offsets, seed=bits + group + offsets)
    gen = torch.Generator().manual_seed(group)
    for m in (1, 5, 33):
        x = torch.randn(m, k, generator=gen)
        check(run(x, w), x, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activations_bias_and_batch_dims(dtype):
    # Group 16 (the smallest, four K-tiles per 64 inputs) and 48 (not a power of two: 16-wide tiles),
    # a bias, and x with two leading dims.
    gen = torch.Generator().manual_seed(5)
    for bits, group, k in ((4, 16, 64), (8, 48, 96)):
        w = random_weight(19, k, bits, group, True, seed=group)
        x = torch.randn(2, 3, k, generator=gen).to(dtype)
        bias = torch.randn(19, generator=gen).to(dtype)
        got = run(x, w, bias)
        assert got.shape == (2, 3, 19)
        check(got.reshape(6, 19), x.reshape(6, k), w, bias)


def test_strided_rows_and_empty_batch():
    # x sliced out of a wider tensor (a fused projection's output): rows strided, unit stride in K.
    w = random_weight(21, 128, 4, 32, True, seed=3)
    wide = torch.randn(7, 200, generator=torch.Generator().manual_seed(3))
    x = wide[:, 40:168]
    check(run(x, w), x.contiguous(), w)
    assert run(torch.empty(0, 128), w).shape == (0, 21)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_weights(kind):
    """GroupQuantWeights as the GGUF loader decodes them (random blocks of each served type)."""
    pytest.importorskip("gguf")
    import numpy as np

    from radixserve.model_loader.gguf_quant import decode_quantized
    from radixserve.testing.tiny_gguf import random_gguf_blocks

    rows, cols = 23, 256
    w = decode_quantized(random_gguf_blocks(kind, rows, cols, np.random.default_rng(1)), kind, rows, cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    check(run(x, w), x, w)


def test_gptq_weight():
    """An asymmetric int4 GPTQ-style weight (the test packer's quantizer, group 32) in the offset
    form the GPTQ / AWQ loaders produce: q * s + (-s * z)."""
    from radixserve.testing.quantized_checkpoints import quantize_int4

    dense = torch.randn(29, 128, generator=torch.Generator().manual_seed(2))
    q, zeros, scale = quantize_int4(dense, 32)
    s = scale.float()
    w = GroupQuantWeight(pack_int4(q), s, -(s * zeros.float()), 32, 4)
    x = torch.randn(33, 128, generator=torch.Generator().manual_seed(4))
    check(run(x, w), x, w)


def test_cpu_path_never_imports_triton():
    """linear_wq on CPU with triton unimportable: the compiled/reference path runs and the Triton
    kernel is never looked for."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
        "import torch\n"
        "from radixserve.layers.group_quant import GroupQuantWeight, linear_wq, linear_wq_reference\n"
        "w = GroupQuantWeight(torch.ones(3, 32, dtype=torch.int8), torch.ones(3, 1), None, 32, 8)\n"
        "x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))\n"
        # fp32 sums of 32 products in the kernel's order vs torch's: a few ulps apart (|diff| up to
        # 6e-7 measured on outputs of ~0.05, past allclose's default 1e-5 relative there).
        "assert torch.allclose(linear_wq(x, w), linear_wq_reference(x, w), rtol=1e-5, atol=1e-5)\n"
        "assert 'sgl_kernel.triton.wq_gemm' not in sys.modules\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_triton_absent_means_no_kernel(monkeypatch):
    import sgl_kernel

    triton_wq_gemm.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(sgl_kernel, "triton_available", lambda: False)
            assert triton_wq_gemm() is None
    finally:
        triton_wq_gemm.cache_clear()
    assert triton_wq_gemm() is wq_gemm


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_wq_dispatches_cuda_to_triton(dtype):
    w = random_weight(4096, 4096, 4, 128, True, seed=0)
    wc = GroupQuantWeight(w.qweight.cuda(), w.scales.cuda(), w.offsets.cuda(), 128, 4)
    for m in (1, 16, 300):
        x = torch.randn(m, 4096, device="cuda").to(dtype)
        got = linear_wq(x, wc)
        assert got.device.type == "cuda"
        check(got.cpu(), x.cpu(), w)
