"""sgl_kernel fused ops (RMSNorm +/- residual, SiLU-and-mul, neox rope) vs radixserve.layers.

CPU: Triton interpreter, fp32, atol=rtol=1e-5 (same math, only rsqrt/exp implementations differ).
GPU: bf16, where the kernels round at the same points as the torch layers: atol=rtol=2e-2.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
try:
    import sgl_kernel  # noqa: F401
except ImportError:  # a checkout without `pip install -e sgl-kernel`
    sys.path.append(str(Path(__file__).resolve().parents[2] / "sgl-kernel"))

from radixserve.layers.activation import silu_and_mul_native as torch_silu_and_mul  # noqa: E402
from radixserve.layers.norm import RMSNorm  # noqa: E402
from radixserve.layers.rotary import RotaryEmbedding  # noqa: E402
from sgl_kernel.triton.fused_ops import rmsnorm, rotary_embedding, silu_and_mul  # noqa: E402

# Without the interpreter, Triton only runs on CUDA tensors: fp32 then runs on the GPU too.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [pytest.param(DEVICE, torch.float32, {"atol": 1e-5, "rtol": 1e-5}, id="fp32")]
if torch.cuda.is_available():
    CASES.append(
        pytest.param(
            "cuda", torch.bfloat16, {"atol": 2e-2, "rtol": 2e-2}, id="cuda-bf16", marks=pytest.mark.gpu
        )
    )


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_rmsnorm(device, dtype, tol, hidden):
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-6).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    x = torch.randn(5, hidden, generator=gen).to(device, dtype)
    res = torch.randn(5, hidden, generator=gen).to(device, dtype)
    with torch.no_grad():
        torch.testing.assert_close(rmsnorm(x, norm.weight, 1e-6), norm.forward_native(x), **tol)
        ref_out, ref_res = norm.forward_native(x, res.clone())
    res_before = res.clone()
    out, new_res = rmsnorm(x, norm.weight, 1e-6, residual=res)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(new_res, ref_res, **tol)
    assert torch.equal(res, res_before), "the input residual must not be modified"


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_silu_and_mul(device, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 2 * 40, generator=gen).to(device, dtype) * 3
    torch.testing.assert_close(silu_and_mul(x), torch_silu_and_mul(x), **tol)


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rotary(device, dtype, tol, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, max_position=64, base=10000.0).to(device)
    positions = torch.randint(0, 64, (7,), generator=gen).to(device)
    q = torch.randn(7, 4, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(7, 2, head_dim, generator=gen).to(device, dtype)
    ref_q, ref_k = rope.forward_native(positions, q, k)
    got_q, got_k = rotary_embedding(positions, q, k, rope.cos_cached, rope.sin_cached)
    torch.testing.assert_close(got_q, ref_q, **tol)
    torch.testing.assert_close(got_k, ref_k, **tol)
