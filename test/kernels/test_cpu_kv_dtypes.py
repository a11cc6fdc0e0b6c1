"""sgl-kernel's CPU decode and extend attention on quantized KV pools (--kv-cache-dtype).

Two references per case, on paged pools (page sizes 1 and 16, ragged lengths, GQA):
- exact: the same attention on the pool's K/V dequantized to fp32 (kv_dtype.dequantize, what the
  torch-native backend reads): the kernels dequantize in their inner loop and must agree to fp32
  rounding (TOL, as the fp32 kernel tests);
- fp32 KV: the unquantized K/V; the error of each dtype is bounded (ERR_BOUND: max abs error of the
  output, K/V ~ N(0, 1)). Measured maxima over these cases: bf16 0.0073, fp8_e4m3 0.127,
  fp8_e5m2 0.237, int8 0.0163 (and below 1.1e-6 against the dequantized reference).
Extend and decode attention on a bf16 pool in an AVX512_BF16 build round q and the softmax weights
to bf16 (their vdpbf16ps paths): against the dequantized reference they are held to BF16_DOT_BOUND
instead of TOL (test_cpu_attention_bf16_dot.py checks those paths against their own references).
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import paged_pool, ref_attention

from radixserve.mem_cache.kv_dtype import dequantize, quantize_int8, to_storage
from sgl_kernel import cpu as cpu_kernels

needs_ext = pytest.mark.skipif(
    torch.int8 not in cpu_kernels.attention_kv_dtypes(),
    reason="sgl_kernel._cpu without quantized-KV attention",
)
needs_extend = pytest.mark.skipif(
    cpu_kernels.extend_attention_isa() == "none", reason="sgl_kernel._cpu built without AVX2"
)
TOL = {"atol": 2e-5, "rtol": 1e-4}
DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
ERR_BOUND = {torch.bfloat16: 0.015, torch.float8_e4m3fn: 0.25, torch.float8_e5m2: 0.45, torch.int8: 0.03}
BF16_DOT_BOUND = 1e-2


def _quantize(
    buf: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A pool buffer stored as `dtype`: (stored, scale or None, its fp32 dequantization)."""
    if dtype == torch.int8:
        q, scale = quantize_int8(buf)
        return q, scale, dequantize(q, scale, torch.float32)
    q = to_storage(buf, dtype)
    return q, None, q.float()


def _case(
    dtype: torch.dtype,
    lens: list[int],
    heads: tuple[int, int],
    head_dim: int,
    page_size: int,
    share: int,
    num_q: int,
):
    gen = torch.Generator().manual_seed(len(lens) * 31 + page_size + head_dim)
    q, k_buf, v_buf, req_to_token, pool_idx, rows = paged_pool(
        lens, page_size, heads[0], heads[1], head_dim, num_q, gen, share=share
    )
    k_q, k_scale, k_deq = _quantize(k_buf, dtype)
    v_q, v_scale, v_deq = _quantize(v_buf, dtype)
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    return q, (k_buf, v_buf), (k_q, v_q, scales), (k_deq, v_deq), req_to_token, pool_idx, rows


DECODE_CASES = [
    # lens, (num_heads, num_kv_heads), head_dim, page_size, shared prefix
    ([1, 17, 130, 300], (4, 4), 64, 1, 0),
    ([5, 33, 77], (6, 2), 64, 16, 0),  # GQA 3
    ([96, 140, 201], (8, 2), 64, 16, 80),  # a shared prefix: the online (cascade) path on AVX2
    ([9, 150], (16, 1), 32, 1, 0),  # 16 heads per KV head: the two-pass path
    ([3, 70], (4, 2), 40, 16, 0),  # head_dim not a multiple of 16
]


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lens,heads,head_dim,page_size,share", DECODE_CASES)
def test_decode_attention_kv_dtypes(dtype, lens, heads, head_dim, page_size, share):
    q, raw, stored, deq, req_to_token, pool_idx, rows = _case(
        dtype, lens, heads, head_dim, page_size, share, len(lens)
    )
    scale = head_dim**-0.5
    q = q.contiguous()
    out = cpu_kernels.decode_attention(
        q, stored[0], stored[1], req_to_token, pool_idx, torch.tensor(lens), scale, **stored[2]
    )
    for b, r in enumerate(rows):
        slots = torch.tensor(r)
        exact = ref_attention(q[b : b + 1], deq[0][slots], deq[1][slots], len(r) - 1, scale)[0]
        bf16_dot = dtype == torch.bfloat16 and heads[0] // heads[1] <= 8
        if bf16_dot and cpu_kernels.decode_attention_bf16_dot(head_dim):
            assert (out[b] - exact).abs().max().item() < BF16_DOT_BOUND
        else:
            torch.testing.assert_close(out[b], exact, **TOL)
        fp32 = ref_attention(q[b : b + 1], raw[0][slots], raw[1][slots], len(r) - 1, scale)[0]
        assert (out[b] - fp32).abs().max().item() < ERR_BOUND[dtype]


EXTEND_CASES = [
    # prefix, extend per request, (num_heads, num_kv_heads), head_dim, page_size
    ([0, 16, 100], [70, 5, 1], (4, 4), 64, 1),
    ([0, 32, 48], [130, 9, 17], (6, 2), 64, 16),
    ([16, 0], [3, 40], (4, 2), 40, 16),
]


@needs_ext
@needs_extend
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prefix,ext,heads,head_dim,page_size", EXTEND_CASES)
def test_extend_attention_kv_dtypes(dtype, prefix, ext, heads, head_dim, page_size):
    lens = [p + e for p, e in zip(prefix, ext)]
    q, raw, stored, deq, req_to_token, pool_idx, rows = _case(
        dtype, lens, heads, head_dim, page_size, 0, sum(ext)
    )
    scale = head_dim**-0.5
    out = cpu_kernels.extend_attention(
        q, stored[0], stored[1], req_to_token, pool_idx, torch.tensor(lens), ext, scale, **stored[2]
    )
    start = 0
    for r, n in zip(rows, ext):
        slots = torch.tensor(r)
        exact = ref_attention(q[start : start + n], deq[0][slots], deq[1][slots], len(r) - n, scale)
        if dtype == torch.bfloat16 and cpu_kernels.extend_attention_bf16_dot():
            assert (out[start : start + n] - exact.reshape(n, -1)).abs().max().item() < BF16_DOT_BOUND
        else:
            torch.testing.assert_close(out[start : start + n], exact.reshape(n, -1), **TOL)
        fp32 = ref_attention(q[start : start + n], raw[0][slots], raw[1][slots], len(r) - n, scale)
        assert (out[start : start + n] - fp32.reshape(n, -1)).abs().max().item() < ERR_BOUND[dtype]
        start += n


@needs_ext
def test_int8_needs_its_scales():
    q, raw, stored, _, req_to_token, pool_idx, _ = _case(torch.int8, [4], (2, 2), 16, 1, 0, 1)
    with pytest.raises(ValueError, match="k_scale"):
        cpu_kernels.decode_attention(
            q.contiguous(), stored[0], stored[1], req_to_token, pool_idx, torch.tensor([4]), 0.25
        )
    with pytest.raises(ValueError, match="k_scale"):  # a float pool takes none
        cpu_kernels.decode_attention(
            q.contiguous(), raw[0], raw[1], req_to_token, pool_idx, torch.tensor([4]), 0.25, **stored[2]
        )


def test_fp8_writes_saturate_and_int8_round_trips():
    x = torch.tensor([[[1000.0, -1000.0, 0.5, 0.0]]])
    assert to_storage(x, torch.float8_e4m3fn).float().tolist() == [[[448.0, -448.0, 0.5, 0.0]]]
    q, scale = quantize_int8(torch.randn(5, 3, 8))
    assert q.dtype == torch.int8 and scale.shape == (5, 3)
    assert q.abs().amax(-1).eq(127).all()  # each row's largest value maps to +-127
    zeros_q, zeros_scale = quantize_int8(torch.zeros(2, 1, 4))
    assert zeros_q.eq(0).all() and zeros_scale.eq(1).all()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=str)
def test_store_kv_writes_the_pools_bits(dtype):
    """The compiled store quantizes as the pool's set_kv_buffer does (the reference): the same
    bytes (and int8 scales), large values saturating in fp8, an all-zero row included."""
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool

    gen = torch.Generator().manual_seed(3)
    pools = [MHATokenToKVPool(64, 16, dtype, 1, 3, 40, "cpu") for _ in range(2)]
    loc = torch.tensor([17, 3, 40, 63, 16])
    k = torch.randn(5, 3, 40, generator=gen) * 3
    v = torch.randn(5, 3, 40, generator=gen)
    k[1, 2] = 0.0  # an all-zero row: int8 scale 1
    v[0, 0, :4] = torch.tensor([1e4, -1e5, 500.0, -449.0])  # beyond fp8 e4m3's 448
    pools[0].set_kv_buffer(0, loc, k, v)
    scales = pools[1].get_kv_scale_buffer(0)
    kw = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
    cpu_kernels.store_kv(*pools[1].get_kv_buffer(0), loc, k, v, **kw)
    for ref, got in zip(pools[0].kv_buffers_of(0), pools[1].kv_buffers_of(0)):
        assert torch.equal(ref.view(torch.uint8), got.view(torch.uint8))
