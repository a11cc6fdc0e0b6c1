"""Shared cases for the attention-kernel tests: paged slot layouts, a dense causal reference, and
an EXTEND -> DECODE -> MIXED parity run of any backend against TorchNativeAttnBackend."""

import torch

from radixserve.layers.attention.radix_attention import RadixAttention
from radixserve.layers.attention.torch_native import TorchNativeAttnBackend
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch


def paged_rows(lens, page_size, num_pages, gen, share=0):
    """Slot rows for requests of lengths `lens`: each request owns pages drawn in shuffled order
    (page 0 is the pool's reserved padding page), tokens contiguous within a page. With
    `share` > 0 (page-aligned), request 1 reuses request 0's first `share` slots: a radix hit."""
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    rows = []
    for i, n in enumerate(lens):
        head = rows[0][:share] if (i == 1 and share) else []
        own = [pages.pop() for _ in range(-(-(n - len(head)) // page_size))]
        rows.append(
            head
            + [own[(p - len(head)) // page_size] * page_size + p % page_size for p in range(len(head), n)]
        )
    return rows


def paged_pool(lens, page_size, num_heads, num_kv_heads, head_dim, num_q, gen, share=0):
    """A random fp32 K/V pool holding requests of `lens` tokens on shuffled pages, their
    req_to_token rows at arbitrary pool rows, and q [num_q, num_heads, head_dim] as a strided view
    (the model slices q out of the fused qkv projection).
    Returns q, k_buf, v_buf, req_to_token, pool_idx, rows."""
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    rows = paged_rows(lens, page_size, num_pages, gen, share=share)
    size = num_pages * page_size
    k_buf = torch.randn(size, num_kv_heads, head_dim, generator=gen)
    v_buf = torch.randn(size, num_kv_heads, head_dim, generator=gen)
    req_to_token = torch.zeros(len(lens) + 2, max(lens) + 7, dtype=torch.int32)
    pool_idx = torch.randperm(len(lens) + 2, generator=gen)[: len(lens)]
    for i, r in zip(pool_idx.tolist(), rows):
        req_to_token[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    qkv = torch.randn(num_q, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv[:, :num_heads], k_buf, v_buf, req_to_token, pool_idx, rows


def ref_attention(q, k, v, prefix_len, scale):
    """q [n, H, D] at positions prefix_len.., k/v [prefix_len + n, Hkv, D]: causal softmax attention."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).float()
    v = v.repeat_interleave(group, 1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = prefix_len + torch.arange(q.shape[0], device=q.device)
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def make_batch(mode, rows, pool_idx, prefix, ext):
    seq_lens = [p + e for p, e in zip(prefix, ext)]
    out_loc = [s for r, p, n in zip(rows, prefix, seq_lens) for s in r[p:n]]
    return ModelWorkerBatch(
        forward_mode=mode,
        input_ids=torch.zeros(len(out_loc), dtype=torch.int64),
        req_pool_indices=torch.tensor(pool_idx),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.tensor(out_loc),
        sampling_info=None,
        extend_seq_lens=None if mode == ForwardMode.DECODE else list(ext),
        extend_prefix_lens=None if mode == ForwardMode.DECODE else list(prefix),
        extend_num_tokens=len(out_loc),
    )


def run_backend_parity(backend_cls, device, dtype, page_size, tol, num_heads=4, num_kv_heads=2, head_dim=16):
    """EXTEND (with radix-style prefix hits) -> DECODE -> MIXED through ForwardBatch on real pools,
    `backend_cls` vs TorchNativeAttnBackend; outputs and the written pools must agree."""
    gen = torch.Generator().manual_seed(page_size)
    device = torch.device(device)
    num_layers, steps_after = 2, 2
    prefix, ext = [16, 16, 0, 3], [5, 2, 11, 20]  # request 1 shares request 0's first page
    final = [p + e + steps_after for p, e in zip(prefix, ext)]
    num_pages = sum(-(-n // page_size) for n in final) + 1
    rows = paged_rows(final, page_size, num_pages + 1, gen, share=16)
    pool_idx = [2, 0, 3, 1]
    pools = []
    for _ in range(2):
        rtp = ReqToTokenPool(5, 64, device)
        for i, r in zip(pool_idx, rows):
            rtp.req_to_token[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        kv = MHATokenToKVPool(
            num_pages * page_size, page_size, dtype, num_layers, num_kv_heads, head_dim, device
        )
        pools.append((rtp, kv))
    for layer_id in range(num_layers):  # the cached prefixes: random, identical in both pools
        for buf in ("k_buffer", "v_buffer"):
            init = torch.randn(getattr(pools[0][1], buf)[layer_id].shape, generator=gen).to(device, dtype)
            for _, kv in pools:
                getattr(kv, buf)[layer_id].copy_(init)
    backends = [TorchNativeAttnBackend(device), backend_cls(device)]
    layers = [RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, i) for i in range(num_layers)]

    plan = [(ForwardMode.EXTEND, prefix, ext)]
    seq = [p + e for p, e in zip(prefix, ext)]
    plan.append((ForwardMode.DECODE, seq, [1] * 4))
    seq = [s + 1 for s in seq]
    # MIXED: requests 0-2 decode, request 3 extends a last chunk of 1 (same shape as a decode).
    plan.append((ForwardMode.MIXED, seq, [1] * 4))
    for mode, pre, ex in plan:
        batch = make_batch(mode, rows, pool_idx, pre, ex)
        n = batch.extend_num_tokens
        fbs = [ForwardBatch.init_new(batch, rtp, kv, be, device) for (rtp, kv), be in zip(pools, backends)]
        for layer in layers:
            q = torch.randn(n, num_heads, head_dim, generator=gen).to(device, dtype)
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(device, dtype)
            ref, got = (layer(q, k, v, fb) for fb in fbs)
            assert got.shape == ref.shape == (n, num_heads * head_dim)
            torch.testing.assert_close(got.float(), ref.float(), **tol)
    for layer_id in range(num_layers):
        assert torch.equal(pools[0][1].k_buffer[layer_id], pools[1][1].k_buffer[layer_id])
        assert torch.equal(pools[0][1].v_buffer[layer_id], pools[1][1].v_buffer[layer_id])
