"""The Triton LoRA delta (lora/triton_bgmv.py) vs the torch-native reference: mixed slots, base
rows, a rank below the pool's, a column slice of a wider output, fp32 and bf16.

Without a CUDA device the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here
before triton is imported). Tolerances: fp32 1e-4 relative to the largest delta (only the
summation order differs); bf16 2e-2 (inputs and the output rounded to bf16, 2^-8 each).
"""

import os

import pytest
import torch

# The root conftest sets TRITON_INTERPRET before any test module imports triton; here again for a
# run of this file outside the repository's test tree.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from radixserve.lora.kernels import lora_delta_reference  # noqa: E402
from radixserve.lora.triton_bgmv import lora_delta_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rank", [8, 12])  # 12: padded to 16 inside the kernel
def test_triton_delta_matches_reference(dtype, tol, rank):
    gen = torch.Generator().manual_seed(rank)
    n, d_in, d_out, num_slots = 7, 96, 80, 4
    slots = torch.tensor([2, -1, 0, 2, 3, -1, 0])
    x = torch.randn(n, d_in, generator=gen)
    a = torch.randn(num_slots, rank, d_in, generator=gen) * 0.2
    b = torch.randn(num_slots, rank, d_out, generator=gen) * 0.2
    wide = torch.randn(n, d_out + 16, generator=gen)
    want = wide.clone()
    lora_delta_reference(x, a, b, slots, want[:, 8 : 8 + d_out])
    dev = {"device": DEVICE}
    got = wide.to(dtype=dtype, **dev).clone()  # .to() of the same dtype and device would alias
    lora_delta_triton(
        x.to(dtype=dtype, **dev), a.to(dtype=dtype, **dev), b.to(dtype=dtype, **dev), slots.to(**dev),
        got[:, 8 : 8 + d_out],
    )  # fmt: skip
    got = got.float().cpu()
    scale = (want - wide).abs().max()
    assert float((got - want).abs().max()) <= tol * float(scale) + (tol if dtype != torch.float32 else 0)
    base_rows = slots < 0
    assert torch.equal(got[base_rows], wide.to(dtype).float()[base_rows])
    assert torch.equal(got[:, :8], wide.to(dtype).float()[:, :8])  # columns outside the slice untouched
