"""sgl-kernel's compiled extend (prefill) attention vs the torch-native backend's semantics.

Every case is a paged batch: each request's slots are scattered over the pool through its
req_to_token row, some requests extend a cached prefix (a radix hit, possibly sharing slots
with another request), and lengths straddle the kernel's 64-key and query-block boundaries.
Skips where the extension (or its AVX2 path) is not built.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_batch, paged_pool, paged_rows, ref_attention

from radixserve.layers.attention.radix_attention import RadixAttention
from radixserve.layers.attention.torch_native import TorchNativeAttnBackend
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode
from sgl_kernel import cpu as cpu_kernels

needs_ext = pytest.mark.skipif(
    cpu_kernels.extend_attention_isa() == "none", reason="sgl_kernel._cpu not built (or built without AVX2)"
)
TOL = {"atol": 2e-5, "rtol": 1e-4}

Inputs = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def _inputs(
    heads: tuple[int, int], head_dim: int, prefix: list[int], ext: list[int], seed: int, page_size: int = 1
) -> tuple[Inputs, list[list[int]]]:
    """Random pool and q for requests with `prefix` cached and `ext` new tokens. Slots are shuffled
    pages (page_size 1: every token anywhere); request 1 reuses request 0's first 16 slots when
    both have that much prefix (a shared radix prefix). q is a strided view, as sliced from qkv."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    seq = [p + e for p, e in zip(prefix, ext)]
    share = 16 if len(seq) > 1 and min(prefix[:2]) >= 16 else 0
    q, k_buf, v_buf, req_to_token, pool_idx, rows = paged_pool(
        seq, page_size, num_heads, num_kv_heads, head_dim, sum(ext), gen, share
    )
    return (q, k_buf, v_buf, req_to_token, pool_idx, torch.tensor(seq), torch.tensor(ext)), rows


def _check_against_reference(inputs: Inputs, rows: list[list[int]], scale: float) -> None:
    q, k_buf, v_buf, req_to_token, pool_idx, seq_lens, ext = inputs
    out = cpu_kernels.extend_attention(q, k_buf, v_buf, req_to_token, pool_idx, seq_lens, ext, scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert out.shape == (q.shape[0], num_heads * head_dim) and out.dtype == torch.float32
    start = 0
    for r, n in zip(rows, ext.tolist()):
        slots = torch.tensor(r)
        ref = ref_attention(q[start : start + n], k_buf[slots], v_buf[slots], len(r) - n, scale)
        torch.testing.assert_close(out[start : start + n], ref.reshape(n, -1), **TOL)
        start += n


# (prefix, extend) per request: a long causal prompt beside short prefixed ones, single-token
# extends, lengths off the 64-key and 32-query block boundaries, and a prefix ending mid-block.
MIXED = ([0, 70, 0, 130, 16], [161, 1, 33, 7, 65])


@needs_ext
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 4), 32), ((6, 2), 24), ((2, 1), 16)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_attention_matches_reference(heads: tuple[int, int], head_dim: int, page_size: int) -> None:
    inputs, rows = _inputs(heads, head_dim, *MIXED, seed=head_dim + page_size, page_size=page_size)
    _check_against_reference(inputs, rows, head_dim**-0.5)


@needs_ext
@pytest.mark.parametrize(
    "prefix,ext",
    [
        ([0], [1]),  # one token, nothing cached
        ([0], [300]),  # one causal prompt: many query blocks, balanced over threads
        ([1024 - 64] * 2 + [200], [64, 64, 1]),  # extends over long cached prefixes
        ([5, 64, 63], [64, 1, 2]),  # prefixes just off / on a key-block boundary
    ],
)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_extend_attention_prefix_and_length_edges(
    prefix: list[int], ext: list[int], heads: tuple[int, int]
) -> None:
    inputs, rows = _inputs(heads, 64, prefix, ext, seed=sum(ext))
    _check_against_reference(inputs, rows, 0.125)


@needs_ext
def test_extend_attention_matches_torch_native_forward_extend() -> None:
    """Through the real pools and ForwardBatch: TorchNativeAttnBackend.forward_extend stores the
    step's K/V and attends; the kernel then reads that same pool and must agree."""
    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_dim, page_size = 9, 3, 64, 16
    prefix, ext = [32, 32, 0, 5], [40, 1, 97, 70]
    seq = [p + e for p, e in zip(prefix, ext)]
    num_pages = sum(-(-n // page_size) for n in seq) + 2
    rows = paged_rows(seq, page_size, num_pages, gen, share=32)
    pool_idx = [3, 0, 2, 1]
    req_to_token_pool = ReqToTokenPool(5, 256, torch.device("cpu"))
    for i, r in zip(pool_idx, rows):
        req_to_token_pool.req_to_token[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    kv_pool = MHATokenToKVPool(
        num_pages * page_size, page_size, torch.float32, 1, num_kv_heads, head_dim, torch.device("cpu")
    )
    kv_pool.k_buffer[0].copy_(torch.randn(kv_pool.k_buffer[0].shape, generator=gen))  # the cached prefixes
    kv_pool.v_buffer[0].copy_(torch.randn(kv_pool.v_buffer[0].shape, generator=gen))
    backend = TorchNativeAttnBackend(torch.device("cpu"))
    batch = make_batch(ForwardMode.EXTEND, rows, pool_idx, prefix, ext)
    fb = ForwardBatch.init_new(batch, req_to_token_pool, kv_pool, backend, torch.device("cpu"))
    layer = RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, 0)
    n = sum(ext)
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    ref = layer(q, k, v, fb)
    k_buf, v_buf = kv_pool.get_kv_buffer(0)
    got = cpu_kernels.extend_attention(
        q, k_buf, v_buf, req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, ext, layer.scaling
    )
    torch.testing.assert_close(got, ref, **TOL)


@needs_ext
def test_extend_attention_writes_into_out() -> None:
    inputs, rows = _inputs((4, 2), 32, [3, 0], [5, 9], seed=2)
    out = torch.full((14, 4 * 32), float("nan"))
    got = cpu_kernels.extend_attention(*inputs, 0.2, out=out)
    assert got is out and not out.isnan().any()


@needs_ext
def test_extend_attention_rejects_bad_inputs() -> None:
    (q, k_buf, v_buf, r2t, pool_idx, seq_lens, ext), _ = _inputs((4, 2), 16, [3, 0], [5, 9], seed=5)

    def call(**overrides: object) -> None:
        args = {
            "q": q,
            "k_buf": k_buf,
            "v_buf": v_buf,
            "req_to_token": r2t,
            "req_pool_indices": pool_idx,
            "seq_lens": seq_lens,
            "extend_lens": ext,
            "scale": 1.0,
        }
        cpu_kernels.extend_attention(**{**args, **overrides})

    cases = [
        ({"q": q.double()}, "q must be float32"),
        ({"k_buf": k_buf.bfloat16()}, "k_buf/v_buf must both be"),  # K and V dtypes differ
        ({"k_buf": k_buf.half(), "v_buf": v_buf.half()}, "must both be one of"),  # fp16 pools: torch-native
        ({"req_to_token": r2t.long()}, "int32"),
        ({"seq_lens": seq_lens.int()}, "int64"),
        ({"extend_lens": ext[:1]}, "int64 \\[bs\\]"),
        ({"q": q[:, :3]}, "num_kv_heads"),
        ({"k_buf": k_buf.transpose(0, 1).contiguous().transpose(0, 1)}, "contiguous"),
        ({"q": q.transpose(1, 2).contiguous().transpose(1, 2)}, "head_dim must be contiguous"),
        (
            {"q": q[..., :12], "k_buf": k_buf[..., :12].contiguous(), "v_buf": v_buf[..., :12].contiguous()},
            "multiple of 8",
        ),
        ({"extend_lens": torch.tensor([5, 8])}, "sum\\(extend_lens\\)"),
        ({"seq_lens": torch.tensor([8, 10_000])}, "seq_len"),
        ({"extend_lens": torch.tensor([9, 5])}, "extend_len"),  # more new tokens than the sequence
        ({"req_pool_indices": torch.tensor([0, 99])}, "req_pool_index"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**overrides)
    bad_slots = r2t.clone()
    bad_slots[pool_idx[0], 0] = k_buf.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="outside the pool"):
        call(req_to_token=bad_slots)
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(14, 4 * 16 + 1))


# ------------------------------------------------------------------------------ draft tree mask
def _random_tree(n: int, gen: torch.Generator) -> list[int]:
    """Row parents of a random tree of n rows (each row's parent an earlier row)."""
    return [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]


def _tree_reference(q, k, v, prefix_len, among_new, scale):
    """q [n, H, D]; k/v [prefix_len + n, Hkv, D]; among_new [n, n] bool: the prefix is visible to
    every row, new key j to row i where among_new[i, j]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).float()
    v = v.repeat_interleave(group, 1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    visible = torch.cat([torch.ones(q.shape[0], prefix_len, dtype=torch.bool), among_new], dim=1)
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@needs_ext
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 4), 32), ((2, 1), 16)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_attention_tree_mask_matches_reference(heads, head_dim, page_size) -> None:
    """Draft trees: each request's new rows see the prefix and their ancestors only. Trees of 1
    row, a few rows, and more than a 64-key block and a query block (rows in several work items,
    the masked keys over several key blocks), with and without a cached prefix."""
    from radixserve.speculative.tree import ancestor_mask, flat_tree_mask

    if not cpu_kernels.extend_attention_takes_tree_mask():
        pytest.skip("this sgl_kernel build has no tree mask")
    prefix, ext = [70, 5, 0, 130, 64], [8, 1, 40, 100, 3]
    inputs, rows = _inputs(heads, head_dim, prefix, ext, seed=7 + head_dim + page_size, page_size=page_size)
    q, k_buf, v_buf, req_to_token, pool_idx, seq_lens, ext_t = inputs
    gen = torch.Generator().manual_seed(head_dim)
    trees = [_random_tree(n, gen) for n in ext]
    mask = flat_tree_mask(trees)
    scale = head_dim**-0.5
    out = cpu_kernels.extend_attention(
        q, k_buf, v_buf, req_to_token, pool_idx, seq_lens, ext_t, scale, tree_mask=mask
    )
    start = 0
    for r, p, n, parents in zip(rows, prefix, ext, trees):
        slots = torch.tensor(r)
        ref = _tree_reference(
            q[start : start + n], k_buf[slots], v_buf[slots], p, ancestor_mask(parents), scale
        )
        torch.testing.assert_close(out[start : start + n], ref.reshape(n, -1), **TOL)
        start += n
    # A chain's mask is the causal one: the output without a mask.
    chain = flat_tree_mask([list(range(-1, n - 1)) for n in ext])
    causal = cpu_kernels.extend_attention(q, k_buf, v_buf, req_to_token, pool_idx, seq_lens, ext_t, scale)
    masked = cpu_kernels.extend_attention(
        q, k_buf, v_buf, req_to_token, pool_idx, seq_lens, ext_t, scale, tree_mask=chain
    )
    torch.testing.assert_close(masked, causal, **TOL)  # key blocks split elsewhere: rounding only


@needs_ext
def test_extend_attention_tree_mask_is_validated() -> None:
    if not cpu_kernels.extend_attention_takes_tree_mask():
        pytest.skip("this sgl_kernel build has no tree mask")
    inputs, _ = _inputs((4, 4), 32, [10], [3], seed=1)
    q, k_buf, v_buf, req_to_token, pool_idx, seq_lens, ext = inputs
    args = (q, k_buf, v_buf, req_to_token, pool_idx, seq_lens, ext, 0.2)
    ok = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 1], dtype=torch.uint8)
    cpu_kernels.extend_attention(*args, tree_mask=ok)
    with pytest.raises(ValueError, match="entries"):
        cpu_kernels.extend_attention(*args, tree_mask=ok[:8].contiguous())
    with pytest.raises(ValueError, match="later row"):
        cpu_kernels.extend_attention(
            *args, tree_mask=torch.tensor([1, 1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="from itself"):
        cpu_kernels.extend_attention(
            *args, tree_mask=torch.tensor([1, 0, 0, 1, 0, 0, 1, 0, 1], dtype=torch.uint8)
        )
