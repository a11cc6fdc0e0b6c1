"""sgl-kernel's decode attention on bf16 pools for short requests (up to 512 tokens, no shared
prefix, no split): on AVX512_BF16 builds they take the whole-request path (attention_short_bf16.h:
all scores, one softmax per query head, then the values) instead of the online-softmax block
steps. Same numerics as the block steps (q * scale and the weights rounded to bf16), so the same
bounds as test_cpu_attention_bf16_dot.py: against the fp32 reference on the same bf16 K/V
< EXACT_BOUND, against the reference with q rounded as the kernel rounds it < Q_ROUNDED_BOUND.
RADIXSERVE_DECODE_ATTENTION_BLOCKS=1 keeps the block steps: the two paths agree within the
weights' rounding."""

from __future__ import annotations

import pytest
import torch
from paged_cases import paged_pool, ref_attention

from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    torch.bfloat16 not in cpu_kernels.attention_kv_dtypes(), reason="sgl_kernel._cpu without bf16 pools"
)
TOL = {"atol": 2e-5, "rtol": 1e-4}
Q_ROUNDED_BOUND = 6e-3  # the weights in bf16 only (2^-9 relative each)
EXACT_BOUND = 1e-2  # the weights and q * scale in bf16
PATHS_BOUND = 6e-3  # whole-request path against block steps (measured 0.0011 at 16 x 1-512 tokens)


def _run(
    lens: list[int],
    heads: tuple[int, int],
    head_dim: int,
    page_size: int,
    share: int,
    seed: int,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], torch.Tensor, torch.Tensor | None]:
    """(q, k_buf, v_buf, rows, out, out with the block steps or None) of a random bf16 pool."""
    gen = torch.Generator().manual_seed(seed)
    q, k_buf, v_buf, req_to_token, pool_idx, rows = paged_pool(
        lens, page_size, heads[0], heads[1], head_dim, len(lens), gen, share=share
    )
    k_buf, v_buf, q = k_buf.bfloat16(), v_buf.bfloat16(), q.contiguous()
    args = (q, k_buf, v_buf, req_to_token, pool_idx, torch.tensor(lens), head_dim**-0.5)
    out = cpu_kernels.decode_attention(*args)
    blocks_out = None
    if monkeypatch is not None:
        monkeypatch.setenv("RADIXSERVE_DECODE_ATTENTION_BLOCKS", "1")
        blocks_out = cpu_kernels.decode_attention(*args)
        monkeypatch.delenv("RADIXSERVE_DECODE_ATTENTION_BLOCKS")
    return q, k_buf, v_buf, rows, out, blocks_out


def _check(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    rows: list[list[int]],
    out: torch.Tensor,
    heads: tuple[int, int],
    head_dim: int,
) -> None:
    scale = head_dim**-0.5
    bf16_dot = cpu_kernels.decode_attention_bf16_dot(head_dim) and heads[0] // heads[1] <= 8
    for b, r in enumerate(rows):
        slots = torch.tensor(r)
        k, v = k_buf[slots], v_buf[slots]
        exact = ref_attention(q[b : b + 1], k, v, len(r) - 1, scale)[0]
        if not bf16_dot:
            torch.testing.assert_close(out[b], exact, **TOL)
            continue
        rounded = ref_attention((q[b : b + 1] * scale).bfloat16().float(), k, v, len(r) - 1, 1.0)[0]
        assert (out[b] - rounded).abs().max().item() < Q_ROUNDED_BOUND
        assert (out[b] - exact).abs().max().item() < EXACT_BOUND


CASES = [
    # lens, (num_heads, num_kv_heads), head_dim, page_size, shared prefix
    ([1, 2, 15, 16, 17, 31, 32, 33], (9, 3), 64, 1, 0),  # around the 16-token blocks and pairs
    ([511, 512, 513, 130], (9, 3), 64, 16, 0),  # around the path's 512-token limit
    ([1], (9, 3), 64, 16, 0),  # one token, one request (a task per KV head on 2 threads)
    ([100, 7, 250], (4, 4), 32, 1, 0),  # one query head per KV head, two value chunks
    ([45, 300], (16, 2), 128, 16, 0),  # 8 query heads per KV head: two value chunks per pass
    ([64, 65, 3], (6, 1), 96, 1, 0),  # head_dim 96: passes of 32
    ([96, 140, 201, 50], (8, 2), 128, 16, 80),  # a shared prefix (cascade) beside a short request
    ([3000, 130, 5], (9, 3), 64, 16, 0),  # a split request (merged) beside short ones
    ([70, 33], (4, 2), 40, 1, 0),  # head_dim not a multiple of 32: the fp32 step
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens,heads,head_dim,page_size,share", CASES)
def test_short_requests_error_is_bounded(
    lens: list[int],
    heads: tuple[int, int],
    head_dim: int,
    page_size: int,
    share: int,
    threads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k_buf, v_buf, rows, out, blocks_out = _run(
            lens, heads, head_dim, page_size, share, sum(lens) + head_dim, monkeypatch=monkeypatch
        )
    finally:
        torch.set_num_threads(before)
    _check(q, k_buf, v_buf, rows, out, heads, head_dim)
    _check(q, k_buf, v_buf, rows, blocks_out, heads, head_dim)
    assert (out - blocks_out).abs().max().item() < PATHS_BOUND


def test_short_requests_random_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(40)
    for trial in range(12):
        g = int(torch.randint(1, 9, (1,), generator=gen))
        hkv = int(torch.randint(1, 4, (1,), generator=gen))
        head_dim = [32, 64, 96, 128][int(torch.randint(0, 4, (1,), generator=gen))]
        bs = int(torch.randint(1, 24, (1,), generator=gen))
        lens = torch.randint(1, 513, (bs,), generator=gen).tolist()
        page_size = [1, 16][trial % 2]
        heads = (g * hkv, hkv)
        q, k_buf, v_buf, rows, out, blocks_out = _run(
            lens, heads, head_dim, page_size, 0, 1000 + trial, monkeypatch=monkeypatch
        )
        _check(q, k_buf, v_buf, rows, out, heads, head_dim)
        assert (out - blocks_out).abs().max().item() < PATHS_BOUND


def test_short_requests_strided_out_matches_contiguous_out() -> None:
    """The whole-request path writes the output rows at their stride: a strided out gets the same
    bits as a contiguous one."""
    lens = [130, 1, 64, 65, 512]
    gen = torch.Generator().manual_seed(7)
    q, k_buf, v_buf, req_to_token, pool_idx, _ = paged_pool(lens, 1, 9, 3, 64, len(lens), gen)
    args = (
        q.contiguous(),
        k_buf.bfloat16(),
        v_buf.bfloat16(),
        req_to_token,
        pool_idx,
        torch.tensor(lens),
        0.125,
    )
    contiguous = cpu_kernels.decode_attention(*args)
    strided = torch.full((len(lens), 9, 128), float("nan"))[:, :, :64]
    cpu_kernels.decode_attention(*args, out=strided)
    assert torch.equal(strided, contiguous)
