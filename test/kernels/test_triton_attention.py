"""Triton attention kernels and TritonAttnBackend vs torch references, on small random paged inputs.

Without a CUDA device the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here
before triton is imported), in fp32 with tiny shapes so the module stays fast on 2 cores.

Tolerances: fp32 kernels vs fp32 torch agree to ~1e-6 (only the summation order differs: online
softmax in base 2, split-KV merge); we assert atol=rtol=1e-4 for headroom. GPU tests run bf16,
where every output is rounded to bf16 (ulp ~4e-3 near 1) and the torch oracle itself runs SDPA
in bf16: atol=rtol=3e-2.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

# Importing the backend also puts sgl-kernel/ on sys.path when it is not pip-installed.
from paged_cases import make_batch, paged_rows, ref_attention, run_backend_parity  # noqa: E402

from radixserve.layers.attention.radix_attention import RadixAttention  # noqa: E402
from radixserve.layers.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.speculative.tree import ancestor_mask, flat_tree_mask  # noqa: E402
from sgl_kernel.triton.decode_attention import decode_attention_fwd  # noqa: E402
from sgl_kernel.triton.extend_attention import extend_attention_fwd  # noqa: E402
from sgl_kernel.triton.kv_store import create_kv_indices, store_kv_cache  # noqa: E402

FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Without the interpreter, Triton only runs on CUDA tensors: the fp32 tests then run on the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_store_kv_and_kv_indices():
    gen = torch.Generator().manual_seed(0)
    k_buf, v_buf = torch.randn(40, 2, 16, device=DEVICE), torch.randn(40, 2, 16, device=DEVICE)
    loc = (torch.randperm(39, generator=gen)[:7] + 1).to(DEVICE)
    k, v = torch.randn(7, 2, 16, device=DEVICE), torch.randn(7, 2, 16, device=DEVICE)
    ref_k, ref_v = k_buf.clone().index_copy_(0, loc, k), v_buf.clone().index_copy_(0, loc, v)
    store_kv_cache(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, ref_k) and torch.equal(v_buf, ref_v)

    req_to_token = torch.randint(0, 1000, (5, 40), dtype=torch.int32, generator=gen).to(DEVICE)
    pool_idx, lens = torch.tensor([3, 0, 4], device=DEVICE), torch.tensor([0, 21, 5], device=DEVICE)
    indptr, indices = create_kv_indices(req_to_token, pool_idx, lens, 26)
    assert indptr.tolist() == [0, 0, 21, 26]
    assert torch.equal(indices, torch.cat([req_to_token[3, :0], req_to_token[0, :21], req_to_token[4, :5]]))


def _decode_case(page_size, num_heads, num_kv_heads, head_dim, dtype, device, lens, max_splits, seed):
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    rows = paged_rows(lens, page_size, num_pages, gen)
    size = num_pages * page_size
    k_buf = torch.randn(size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v_buf = torch.randn(size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    req_to_token = torch.zeros(len(lens) + 1, max(lens) + 3, dtype=torch.int32)
    for i, r in enumerate(rows):
        req_to_token[i + 1, : len(r)] = torch.tensor(r, dtype=torch.int32)  # rows 1.. (row 0 unused)
    req_to_token = req_to_token.to(device)
    pool_idx = torch.arange(1, len(lens) + 1, device=device)
    seq_lens = torch.tensor(lens, device=device)
    indptr, indices = create_kv_indices(req_to_token, pool_idx, seq_lens, sum(lens))
    splits = torch.randint(1, max_splits + 1, (len(lens),), generator=gen).to(device, torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(device, dtype)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    decode_attention_fwd(q, k_buf, v_buf, out, indptr, indices, splits, max_splits, scale)
    for i, r in enumerate(rows):
        slots = torch.tensor(r, device=device)
        ref = ref_attention(q[i : i + 1], k_buf[slots], v_buf[slots], len(r) - 1, scale)[0]
        yield out[i].float(), ref


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_decode_kernel(page_size, heads):
    # Lengths: a single token, lengths around the 16-token block, and a split count (up to 4) that
    # can exceed the length (empty splits must drop out of the merge).
    lens = [1, 2, 17, 40]
    for got, ref in _decode_case(page_size, *heads, 16, torch.float32, DEVICE, lens, 4, seed=page_size):
        torch.testing.assert_close(got, ref, **FP32_TOL)


def _extend_case(page_size, num_heads, num_kv_heads, head_dim, dtype, device, prefix, ext, seed, share=0):
    gen = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in zip(prefix, ext)]
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    rows = paged_rows(lens, page_size, num_pages, gen, share=share)
    size = num_pages * page_size
    k_buf = torch.randn(size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v_buf = torch.randn(size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    req_to_token = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    for i, r in enumerate(rows):
        req_to_token[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    req_to_token = req_to_token.to(device)
    n = sum(ext)
    q = torch.randn(n, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    out_loc = torch.tensor([s for r, p in zip(rows, prefix) for s in r[p:]], device=device)
    store_kv_cache(k_buf, v_buf, out_loc, k, v)
    pool_idx = torch.arange(len(lens), device=device)
    kv_indptr, kv_indices = create_kv_indices(
        req_to_token, pool_idx, torch.tensor(prefix, device=device), sum(prefix)
    )
    qo_indptr = torch.tensor([0, *torch.tensor(ext).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    extend_attention_fwd(q, k, v, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, max(ext), scale)
    for i, r in enumerate(rows):
        a, b = qo_indptr[i].item(), qo_indptr[i + 1].item()
        slots = torch.tensor(r, device=device)
        yield out[a:b].float(), ref_attention(q[a:b], k_buf[slots], v_buf[slots], prefix[i], scale)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 16), ((4, 4), 32)])
def test_extend_kernel(page_size, heads, head_dim):
    # Prefix hits (incl. a shared page-aligned prefix), no prefix, an extend of 1 (a decode inside
    # a MIXED batch) and an extend spanning two 16-row query blocks.
    prefix, ext = [16, 16, 0, 5], [3, 18, 9, 1]
    for got, ref in _extend_case(
        page_size, *heads, head_dim, torch.float32, DEVICE, prefix, ext, seed=7, share=16
    ):
        torch.testing.assert_close(got, ref, **FP32_TOL)


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_matches_torch_native(page_size):
    run_backend_parity(TritonAttnBackend, DEVICE, torch.float32, page_size, FP32_TOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_matches_torch_native_cuda_bf16(page_size):
    run_backend_parity(
        TritonAttnBackend,
        "cuda",
        torch.bfloat16,
        page_size,
        BF16_TOL,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])
def test_kernels_cuda_bf16_real_blocks(heads):
    # GPU block sizes (64-wide tiles, up to 16 splits) on longer sequences than the interpreter runs.
    lens = [1, 63, 64, 65, 1000, 3001]
    for got, ref in _decode_case(16, *heads, 128, torch.bfloat16, "cuda", lens, 16, seed=1):
        torch.testing.assert_close(got, ref, **BF16_TOL)
    prefix, ext = [128, 128, 500, 0], [300, 1, 129, 64]
    for got, ref in _extend_case(16, *heads, 128, torch.bfloat16, "cuda", prefix, ext, seed=2, share=128):
        torch.testing.assert_close(got, ref, **BF16_TOL)


# ------------------------------------------------------------------------------ draft tree mask
def _random_tree(n, gen):
    """Row parents of a random tree of n rows (each row's parent an earlier row, -1 for the root)."""
    return [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]


def _tree_case(page_size, prefix, ext, heads, kv_heads, dim, device, dtype, tol):
    """extend_attention_fwd with random draft trees vs a dense fp32 reference (every row sees the
    whole prefix and its ancestors and itself among the new rows); then a chain's mask must give
    exactly the kernel's plain causal output."""
    gen = torch.Generator().manual_seed(11 + page_size)
    lens = [p + e for p, e in zip(prefix, ext)]
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    rows = paged_rows(lens, page_size, num_pages, gen)
    k_buf = torch.randn(num_pages * page_size, kv_heads, dim, generator=gen).to(device, dtype)
    v_buf = torch.randn(num_pages * page_size, kv_heads, dim, generator=gen).to(device, dtype)
    req_to_token = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    for i, r in enumerate(rows):
        req_to_token[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    n = sum(ext)
    q = torch.randn(n, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(n, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(n, kv_heads, dim, generator=gen).to(device, dtype)
    store_kv_cache(
        k_buf, v_buf, torch.tensor([s for r, p in zip(rows, prefix) for s in r[p:]], device=device), k, v
    )
    kv_indptr, kv_indices = create_kv_indices(
        req_to_token.to(device),
        torch.arange(len(lens), device=device),
        torch.tensor(prefix, device=device),
        sum(prefix),
    )
    qo_indptr = torch.tensor([0, *torch.tensor(ext).cumsum(0).tolist()], dtype=torch.int32, device=device)
    mask_indptr = torch.tensor(
        [0, *torch.tensor([e * e for e in ext]).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    trees = [_random_tree(e, gen) for e in ext]
    scale = dim**-0.5

    def run(mask):
        out = torch.empty_like(q)
        extend_attention_fwd(
            q,
            k,
            v,
            out,
            k_buf,
            v_buf,
            qo_indptr,
            kv_indptr,
            kv_indices,
            max(ext),
            scale,
            tree_mask=None if mask is None else mask.to(device),
            mask_indptr=mask_indptr,
        )
        return out

    out = run(flat_tree_mask(trees))
    for i, (r, p, e) in enumerate(zip(rows, prefix, ext)):
        a, b = qo_indptr[i].item(), qo_indptr[i + 1].item()
        slots = torch.tensor(r, device=device)
        visible = torch.cat([torch.ones(e, p, dtype=torch.bool), ancestor_mask(trees[i])], 1).to(device)
        group = heads // kv_heads
        kk = k_buf[slots].repeat_interleave(group, 1).float()
        vv = v_buf[slots].repeat_interleave(group, 1).float()
        s = torch.einsum("qhd,khd->hqk", q[a:b].float(), kk) * scale
        ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible[None], float("-inf")).softmax(-1), vv)
        torch.testing.assert_close(out[a:b].float(), ref, **tol)
    # A chain is the causal mask: the kernel without one computes the same tiles in the same order.
    # Identical in the interpreter; compiled, the two specialisations are two binaries whose
    # instruction selection (FMA contraction) may differ in the last bits.
    chain = flat_tree_mask([list(range(-1, e - 1)) for e in ext])
    with_chain, causal = run(chain), run(None)
    if q.device.type == "cpu":
        assert torch.equal(with_chain, causal)
    else:
        diff = float((with_chain.float() - causal.float()).abs().max())
        print(f"chain mask vs causal kernel, max abs difference: {diff:.3g}")
        torch.testing.assert_close(with_chain, causal, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_kernel_tree_mask(page_size):
    # A tree of 1 row, small trees, and one of 20 rows (two 16-row query blocks and two key tiles
    # in the interpreter), with and without a prefix.
    _tree_case(page_size, [16, 0, 5, 21], [7, 20, 1, 4], 4, 2, 16, DEVICE, torch.float32, FP32_TOL)


@pytest.mark.gpu
@needs_cuda
def test_extend_kernel_tree_mask_cuda_bf16():
    # GPU tiles (64 rows): trees of up to 100 rows over prefixes of a few hundred tokens.
    _tree_case(16, [300, 0, 64, 1000], [7, 100, 1, 65], 32, 8, 128, "cuda", torch.bfloat16, BF16_TOL)


def _verify_parity(page_size, trees):
    """A TARGET_VERIFY step through ForwardBatch, Triton vs torch-native on identical pools:
    `trees` per request row parents (None: a chain verify, plain causal extend)."""
    gen = torch.Generator().manual_seed(3 + page_size)
    heads, kv_heads, dim = 4, 2, 16
    prefix, ext = [19, 16, 3, 40], [7, 1, 4, 18]  # request 1 shares request 0's first page
    lens = [p + e for p, e in zip(prefix, ext)]
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    rows = paged_rows(lens, page_size, num_pages, gen, share=16)
    pool_idx = [1, 3, 0, 2]
    device = torch.device(DEVICE)
    pools = []
    for _ in range(2):
        rtp = ReqToTokenPool(4, 64, device)
        for i, r in zip(pool_idx, rows):
            rtp.req_to_token[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        pools.append(
            (rtp, MHATokenToKVPool(num_pages * page_size, page_size, torch.float32, 1, kv_heads, dim, device))
        )
    for buf in ("k_buffer", "v_buffer"):
        init = torch.randn(getattr(pools[0][1], buf)[0].shape, generator=gen).to(device)
        for _, kv in pools:
            getattr(kv, buf)[0].copy_(init)
    batch = make_batch(ForwardMode.TARGET_VERIFY, rows, pool_idx, prefix, ext)
    batch.spec_tree_parents = trees
    backends = [TorchNativeAttnBackend(device), TritonAttnBackend(device)]
    fbs = [ForwardBatch.init_new(batch, rtp, kv, be, device) for (rtp, kv), be in zip(pools, backends)]
    assert (fbs[1].spec_tree_mask is None) == (trees is None)
    layer = RadixAttention(heads, dim, dim**-0.5, kv_heads, 0)
    n = sum(ext)
    q = torch.randn(n, heads, dim, generator=gen).to(device)
    k = torch.randn(n, kv_heads, dim, generator=gen).to(device)
    v = torch.randn(n, kv_heads, dim, generator=gen).to(device)
    ref, got = (layer(q, k, v, fb) for fb in fbs)
    torch.testing.assert_close(got, ref, **FP32_TOL)
    assert torch.equal(pools[0][1].k_buffer[0], pools[1][1].k_buffer[0])
    return got


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_tree_verify_matches_torch_native(page_size):
    gen = torch.Generator().manual_seed(page_size)
    trees = [_random_tree(e, gen) for e in (7, 1, 4, 18)]
    tree_out = _verify_parity(page_size, trees)
    chain_out = _verify_parity(page_size, None)  # a chain verify: the plain causal extend
    # Same q/k/v and pool: the trees must actually change the attention (they are not chains).
    assert not torch.allclose(tree_out, chain_out)
