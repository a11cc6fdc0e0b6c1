"""sgl-kernel's extend and decode attention on bf16 K/V pools, which AVX512_BF16 builds compute by
vdpbf16ps (extend: its tiles; decode: its block step, head_dim a multiple of 32, up to 8 query
heads per KV head).

There q * scale and the softmax weights P are rounded to bf16 before their fp32-accumulated
products (sgl_kernel.cpu.extend_attention_bf16_dot / decode_attention_bf16_dot). Two references
per case, on paged pools (page sizes 1 and 16, GQA, lengths off the block boundaries, cached and
shared prefixes):
- q rounded: the torch reference on the pool's own K/V with q * scale rounded to bf16 as the
  kernel rounds it; what is left is P's rounding: max abs error < Q_ROUNDED_BOUND;
- exact: the fp32 reference on the same pool (what the fp32 tiles match to TOL): max abs error
  < EXACT_BOUND. q, K, V ~ N(0, 1) (outputs of magnitude ~0.1-1); measured maxima over these
  cases on Zen 4: see the bounds' comments.
Builds without AVX512_BF16 (and shapes the bf16 step does not take) run the fp32 step on bf16
pools, which must match the exact reference to TOL: the same cases check that instead.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import paged_pool, ref_attention

from sgl_kernel import cpu as cpu_kernels

needs_extend = pytest.mark.skipif(
    cpu_kernels.extend_attention_isa() == "none"
    or torch.bfloat16 not in cpu_kernels.extend_attention_kv_dtypes(),
    reason="sgl_kernel._cpu built without AVX2 or bf16 pools",
)
BF16_DOT = cpu_kernels.extend_attention_bf16_dot()
TOL = {"atol": 2e-5, "rtol": 1e-4}
Q_ROUNDED_BOUND = 6e-3  # P in bf16 only (2^-9 relative per weight; measured 0.0038)
EXACT_BOUND = 1e-2  # P and q * scale in bf16 (measured 0.0055)

CASES = [
    # prefix, extend per request, (num_heads, num_kv_heads), head_dim, page_size
    ([0], [300], (9, 3), 64, 1),  # the built-in model's shape: one causal prompt, many blocks
    ([0, 70, 0, 130, 16], [161, 1, 33, 7, 65], (9, 3), 64, 16),
    ([5, 64, 63], [64, 1, 2], (4, 4), 64, 1),  # prefixes just off / on a key-block boundary
    ([0, 32], [97, 9], (6, 2), 24, 16),  # head_dim below a register: masked pairs
    ([16, 0], [3, 40], (4, 2), 40, 1),  # head_dim not a multiple of 32
    ([0], [129], (2, 1), 128, 16),
]


def _ref(q, k, v, prefix_len, scale, round_q):
    if round_q:  # the kernel's q: scale folded in, then rounded to bf16
        return ref_attention((q.float() * scale).bfloat16().float(), k, v, prefix_len, 1.0)
    return ref_attention(q, k, v, prefix_len, scale)


@needs_extend
@pytest.mark.parametrize("prefix,ext,heads,head_dim,page_size", CASES)
def test_extend_attention_bf16_pool_error_is_bounded(prefix, ext, heads, head_dim, page_size):
    lens = [p + e for p, e in zip(prefix, ext)]
    gen = torch.Generator().manual_seed(sum(lens) + head_dim)
    q, k_buf, v_buf, req_to_token, pool_idx, rows = paged_pool(
        lens, page_size, heads[0], heads[1], head_dim, sum(ext), gen
    )
    k_buf, v_buf = k_buf.bfloat16(), v_buf.bfloat16()
    scale = head_dim**-0.5
    out = cpu_kernels.extend_attention(
        q, k_buf, v_buf, req_to_token, pool_idx, torch.tensor(lens), ext, scale
    )
    start = 0
    for r, n in zip(rows, ext):
        slots = torch.tensor(r)
        got = out[start : start + n]
        k, v, prefix_len = k_buf[slots], v_buf[slots], len(r) - n
        exact = _ref(q[start : start + n], k, v, prefix_len, scale, False).reshape(n, -1)
        if not BF16_DOT:
            torch.testing.assert_close(got, exact, **TOL)
        else:
            rounded = _ref(q[start : start + n], k, v, prefix_len, scale, True).reshape(n, -1)
            assert (got - rounded).abs().max().item() < Q_ROUNDED_BOUND
            assert (got - exact).abs().max().item() < EXACT_BOUND
        start += n


@needs_extend
def test_extend_attention_fp32_pool_stays_exact_beside_bf16():
    """The same batch on an fp32 pool matches the fp32 reference to fp32 rounding: the bf16-dot
    tiles are for bf16 pools only."""
    lens, ext = [300], [300]
    gen = torch.Generator().manual_seed(7)
    q, k_buf, v_buf, req_to_token, pool_idx, rows = paged_pool(lens, 1, 9, 3, 64, 300, gen)
    out = cpu_kernels.extend_attention(
        q, k_buf, v_buf, req_to_token, pool_idx, torch.tensor(lens), ext, 0.125
    )
    slots = torch.tensor(rows[0])
    ref = ref_attention(q, k_buf[slots], v_buf[slots], 0, 0.125).reshape(300, -1)
    torch.testing.assert_close(out, ref, **TOL)


DECODE_CASES = [
    # lens, (num_heads, num_kv_heads), head_dim, page_size, shared prefix
    ([2048, 2047, 1500, 33], (9, 3), 64, 1, 0),  # the built-in model at 2k context
    ([1], (9, 3), 64, 16, 0),  # a single token
    ([96, 140, 201], (8, 2), 128, 16, 80),  # a shared prefix folded for three requests
    ([5, 17, 300], (6, 1), 32, 1, 0),  # 6 heads per KV head: two value chunks per pass
    ([77, 130], (3, 1), 96, 16, 0),  # head_dim 96: passes of 32
    ([9, 150], (16, 1), 32, 1, 0),  # 16 heads per KV head: the fp32 two-pass path
    ([3, 70], (4, 2), 40, 16, 0),  # head_dim not a multiple of 32: the fp32 step
    ([63, 64, 65, 127, 128, 129, 130], (9, 3), 64, 1, 0),  # around the bf16 step's 64 tokens
    ([3000, 130, 5], (9, 3), 64, 16, 0),  # a split request (merged parts) beside unsplit ones
    ([200, 70], (4, 1), 128, 1, 0),  # head_dim 128: two value passes per step
]


@pytest.mark.skipif(
    torch.bfloat16 not in cpu_kernels.attention_kv_dtypes(), reason="sgl_kernel._cpu without bf16 pools"
)
@pytest.mark.parametrize("lens,heads,head_dim,page_size,share", DECODE_CASES)
def test_decode_attention_bf16_pool_error_is_bounded(lens, heads, head_dim, page_size, share):
    gen = torch.Generator().manual_seed(sum(lens) + head_dim)
    q, k_buf, v_buf, req_to_token, pool_idx, rows = paged_pool(
        lens, page_size, heads[0], heads[1], head_dim, len(lens), gen, share=share
    )
    k_buf, v_buf, q = k_buf.bfloat16(), v_buf.bfloat16(), q.contiguous()
    scale = head_dim**-0.5
    out = cpu_kernels.decode_attention(q, k_buf, v_buf, req_to_token, pool_idx, torch.tensor(lens), scale)
    bf16_dot = cpu_kernels.decode_attention_bf16_dot(head_dim) and heads[0] // heads[1] <= 8
    for b, r in enumerate(rows):
        slots = torch.tensor(r)
        k, v = k_buf[slots], v_buf[slots]
        exact = _ref(q[b : b + 1], k, v, len(r) - 1, scale, False)[0]
        if not bf16_dot:
            torch.testing.assert_close(out[b], exact, **TOL)
        else:
            rounded = _ref(q[b : b + 1], k, v, len(r) - 1, scale, True)[0]
            assert (out[b] - rounded).abs().max().item() < Q_ROUNDED_BOUND
            assert (out[b] - exact).abs().max().item() < EXACT_BOUND


@needs_extend
def test_extend_attention_bf16_pool_tree_mask_error_is_bounded():
    """Draft trees (speculative verify) on a bf16 pool: each new row sees the prefix and its
    ancestors; the vdpbf16ps tiles mask the same keys as the fp32 ones (hidden weights exactly 0),
    so only the bf16 rounding separates the output from the exact tree reference."""
    from radixserve.speculative.tree import ancestor_mask, flat_tree_mask

    if not cpu_kernels.extend_attention_takes_tree_mask():
        pytest.skip("this sgl_kernel build has no tree mask")
    prefix, ext = [70, 0, 130], [8, 40, 100]
    lens = [p + e for p, e in zip(prefix, ext)]
    gen = torch.Generator().manual_seed(11)
    q, k_buf, v_buf, req_to_token, pool_idx, rows = paged_pool(lens, 16, 9, 3, 64, sum(ext), gen)
    k_buf, v_buf = k_buf.bfloat16(), v_buf.bfloat16()
    trees = [[-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)] for n in ext]
    out = cpu_kernels.extend_attention(
        q,
        k_buf,
        v_buf,
        req_to_token,
        pool_idx,
        torch.tensor(lens),
        ext,
        0.125,
        tree_mask=flat_tree_mask(trees),
    )
    start = 0
    for r, p, n, parents in zip(rows, prefix, ext, trees):
        slots = torch.tensor(r)
        k = k_buf[slots].repeat_interleave(3, 1).float()
        v = v_buf[slots].repeat_interleave(3, 1).float()
        s = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), k) * 0.125
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool), ancestor_mask(parents)], dim=1)
        ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible[None], float("-inf")).softmax(-1), v)
        err = (out[start : start + n] - ref.reshape(n, -1)).abs().max().item()
        # fp32 tiles on a bf16 pool: fp32 rounding only (TOL's atol plus its rtol on outputs below 1).
        assert err < (EXACT_BOUND if BF16_DOT else TOL["atol"] + TOL["rtol"])
        start += n


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_strided_out_matches_contiguous_out(kv_dtype):
    """Requests folded in one part accumulate straight into a contiguous out and are normalized
    there; a strided out (head rows not adjacent) takes the part states and the merge pass
    instead. A one-part merge computes the same products in the same order, so both outputs are
    bit-identical; a split request (3000 tokens) goes through the merge either way."""
    lens = [130, 3000, 1, 64, 65]
    gen = torch.Generator().manual_seed(5)
    q, k_buf, v_buf, req_to_token, pool_idx, _ = paged_pool(lens, 16, 9, 3, 64, len(lens), gen)
    k_buf, v_buf, q = k_buf.to(kv_dtype), v_buf.to(kv_dtype), q.contiguous()
    args = (q, k_buf, v_buf, req_to_token, pool_idx, torch.tensor(lens), 0.125)
    contiguous = cpu_kernels.decode_attention(*args)
    strided = torch.full((len(lens), 9, 128), float("nan"))[:, :, :64]
    cpu_kernels.decode_attention(*args, out=strided)
    assert torch.equal(strided, contiguous)
