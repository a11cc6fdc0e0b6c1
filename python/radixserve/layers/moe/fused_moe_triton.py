"""The MoE experts as Triton kernels (GPU; the tests run them in Triton's CPU interpreter,
TRITON_INTERPRET=1, against fused_moe_native). Same contract as the other two implementations.

The (token, expert) pairs are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M (`align_pairs`, on the host side in torch): every block of BLOCK_M sorted pairs then
belongs to one expert, and one program computes a [BLOCK_M, BLOCK_N] tile of that expert's
output, reading only its own expert's weights. Two launches of one grouped-GEMM kernel:

1. gate_up: rows are the pairs' tokens of `hidden` (pair // top_k), weights w13[e] -> [pairs, 2I];
2. silu(gate) * up in torch -> [pairs, I];
3. down: rows are the pairs themselves, weights w2[e], each row scaled by its routing weight ->
   [pairs, H], summed over each token's top_k pairs.

Padding slots carry the pair id `num_pairs` (past the end): their loads are masked and their
stores skipped. An expert that got no pair has no block, so its weights are never read. The grid
is sized for the worst routing (no host synchronisation, so it runs inside a CUDA graph): spare
blocks hold padding only and return at once. fp32 accumulation whatever the input dtype.
"""

# Triton parses @triton.jit parameter annotations (tl.constexpr, dtype hints), so kernel
# arguments stay unannotated; every host-side function is fully typed.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.activation import silu_and_mul
from sgl_kernel.triton._common import dot_precision, on_interpreter

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _grouped_gemm(
    a_ptr,
    b_ptr,
    c_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    weights_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    ROW_DIV: tl.constexpr,
    SCALE_BY_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    F32_OPERANDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[pair, n] = a[pair // ROW_DIV] . b[expert of the block][n] (x the pair's weight)."""
    block = tl.program_id(0)
    col_block = tl.program_id(1)
    # Padding sits at the end of an expert's run, so a block whose first slot is padding holds no
    # pair at all: one of the spare blocks of the static grid (align_pairs). It reads nothing.
    if tl.load(pair_ids_ptr + block * BLOCK_M) >= num_pairs:
        return
    expert = tl.load(block_expert_ptr + block)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + offs_m)
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs, 0) // ROW_DIV
    offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        b = tl.load(
            b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )
        # Operands in the weights' dtype (bf16 runs on the tensor cores; the fp32 activation of
        # the down projection is rounded to it, as a bf16 model's HF twin does), fp32 accumulation.
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        ).to(b.dtype)
        if F32_OPERANDS:  # the CPU interpreter: its bf16 tl.dot returns garbage (Triton 3.8)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if SCALE_BY_WEIGHT:
        w = tl.load(weights_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align_pairs(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by expert, each expert's run padded with `num_pairs` to a multiple of
    block_m; the expert of each block). Pairs are numbered token * top_k + k.

    Sizes depend only on the shapes, never on the routing, and nothing is read back to the host:
    a decode step runs inside a CUDA graph, which can neither synchronise nor change a launch's
    grid. So both outputs have the most blocks any routing can need (each expert's run adds at most
    block_m - 1 slots of padding); the blocks past the used ones hold padding only, which the
    kernel skips, and name the last expert."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    # scatter_add_, not bincount: bincount on CUDA reads the largest id back to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    block_ends = ((counts + block_m - 1) // block_m).cumsum(0)  # each expert's end, in blocks
    pad_starts = (block_ends - (counts + block_m - 1) // block_m) * block_m
    starts = counts.cumsum(0) - counts  # each expert's first slot in `order`
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=dev) - starts[sorted_experts]
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=dev)
    pair_ids[pad_starts[sorted_experts] + rank_in_expert] = order
    blocks = torch.arange(num_blocks, device=dev)
    block_expert = torch.searchsorted(block_ends, blocks, right=True).clamp_(max=max(num_experts - 1, 0))
    return pair_ids, block_expert


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    weights: torch.Tensor,
    row_div: int,
    scale: bool,
) -> None:
    n, k = b.shape[1], b.shape[2]
    interp = on_interpreter(a)
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm[grid](
        a, b, out, pair_ids, block_expert, weights, n, k, out.shape[0],
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        ROW_DIV=row_div, SCALE_BY_WEIGHT=scale, F32_OPERANDS=interp,
        DOT_PRECISION=dot_precision(torch.float32 if interp else b.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def fused_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fused_moe_native.fused_experts_native's contract: [num_tokens, hidden_size] in hidden's dtype."""
    num_tokens, top_k = topk_ids.shape
    hidden = hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    pair_ids, block_expert = align_pairs(topk_ids, w13.shape[0])
    num_pairs = num_tokens * top_k
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _launch(hidden, w13, gate_up, pair_ids, block_expert, weights, top_k, False)
    act = silu_and_mul(gate_up).contiguous()  # [pairs, inter]
    down = torch.empty(num_pairs, w2.shape[1], dtype=torch.float32, device=hidden.device)
    _launch(act, w2, down, pair_ids, block_expert, weights, 1, True)
    return down.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
