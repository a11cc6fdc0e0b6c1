"""The Triton MoE experts (layers/moe/fused_moe_triton.py) vs the torch-native reference: top-k
1, 2 and 8, experts that get no token, shapes that are not multiples of the blocks, a batch whose
every pair goes to one expert, fp32 and bf16; and the pair alignment on its own.

Without a CUDA device the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by the
root conftest before anything imports triton). Tolerances: fp32 1e-4 relative to the output's
largest value (only the summation order differs); bf16 2e-2 (inputs rounded to bf16, 2^-8 each).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from radixserve.layers.moe.fused_moe_native import fused_experts_native  # noqa: E402
from radixserve.layers.moe.fused_moe_triton import BLOCK_M, align_pairs, fused_experts_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int, skip: int = 0):
    """Random weights and a routing that never picks the last `skip` experts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    scores = torch.rand(tokens, experts - skip, generator=gen)
    weights, ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, skip",
    [(5, 4, 1, 48, 40, 1), (19, 8, 2, 64, 72, 3), (3, 16, 8, 40, 24, 4), (33, 6, 2, 96, 64, 0)],
)
def test_triton_experts_match_native(dtype, tol, tokens, experts, top_k, hidden, inter, skip):
    x, w13, w2, weights, ids = _case(tokens + experts, tokens, experts, top_k, hidden, inter, skip)
    want = fused_experts_native(x, w13, w2, weights, ids)
    dev = {"device": DEVICE, "dtype": dtype}
    got = fused_experts_triton(x.to(**dev), w13.to(**dev), w2.to(**dev), weights.to(DEVICE), ids.to(DEVICE))
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


def test_every_pair_on_one_expert():
    x, w13, w2, weights, _ = _case(0, 21, 4, 2, 32, 32)
    ids = torch.tensor([[2, 2]] * 21)  # 42 pairs: three blocks of expert 2, none for the others
    want = fused_experts_native(x, w13, w2, weights, ids)
    got = fused_experts_triton(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids))).cpu()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_alignment_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])  # pairs 0..5; expert 2 gets none
    pair_ids, block_expert = align_pairs(ids, 4)
    # The worst routing needs ceil((6 + 4 * (BLOCK_M - 1)) / BLOCK_M) blocks: the grid is that big
    # whatever the routing (a CUDA graph replays one grid). Used blocks come first, one per expert
    # with pairs, in expert order; the spare ones are padding only and name the last expert.
    num_blocks = -(-(6 + 4 * (BLOCK_M - 1)) // BLOCK_M)
    assert block_expert.tolist() == [0, 1, 3] + [3] * (num_blocks - 3)
    blocks = pair_ids.view(-1, BLOCK_M)
    pad = ids.numel()
    want = [[1, 4], [3], [0, 2, 5]] + [[]] * (num_blocks - 3)
    assert [sorted(p for p in b.tolist() if p != pad) for b in blocks] == want
    assert all(b[0] != pad for b in blocks[:3]) and bool((blocks[3:] == pad).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_experts_on_cuda_in_bf16():
    """The GPU run of the kernel (scripts/gpu/run_checks.sh tests selects the gpu-marked tests)."""
    x, w13, w2, weights, ids = _case(7, 64, 16, 4, 256, 128, 2)
    want = fused_experts_native(x, w13, w2, weights, ids)
    dev = {"device": "cuda", "dtype": torch.bfloat16}
    got = fused_experts_triton(x.to(**dev), w13.to(**dev), w2.to(**dev), weights.cuda(), ids.cuda())
    assert (got.float().cpu() - want).abs().max().item() <= 2e-2 * want.abs().max().item()
