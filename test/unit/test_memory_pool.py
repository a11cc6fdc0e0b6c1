"""ReqToTokenPool and MHATokenToKVPool."""

import pytest
import torch

from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def test_req_to_token_pool_alloc_free():
    pool = ReqToTokenPool(size=4, max_context_len=16, device="cpu")
    assert pool.req_to_token.shape == (4, 16) and pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(3)
    assert rows is not None and len(set(rows)) == 3 and pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1
    pool.free(rows[0])
    pool.free(rows[1:])
    assert pool.available_size() == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(rows[0])
    with pytest.raises(ValueError):
        pool.free(7)
    pool.alloc(4)
    pool.clear()
    assert pool.available_size() == 4


def test_kv_pool_shapes_and_write_with_cast():
    pool = MHATokenToKVPool(
        size=16, page_size=4, dtype=torch.bfloat16, num_layers=2, num_kv_heads=2, head_dim=8, device="cpu"
    )
    assert len(pool.k_buffer) == 2 and pool.get_key_buffer(1).shape == (20, 2, 8)
    assert pool.get_value_buffer(0).dtype == torch.bfloat16
    loc = torch.tensor([5, 9, 19])
    k = torch.randn(3, 2, 8)  # fp32: must be cast
    v = torch.randn(3, 2, 8)
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k.to(torch.bfloat16))
    assert torch.equal(pool.get_value_buffer(1)[loc], v.to(torch.bfloat16))
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layer untouched
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes == v_bytes == 2 * 20 * 2 * 8 * 2


def test_kv_bytes_per_token():
    assert MHATokenToKVPool.kv_bytes_per_token(30, 3, 64, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert MHATokenToKVPool.kv_bytes_per_token(32, 8, 128, torch.bfloat16) == 131072
