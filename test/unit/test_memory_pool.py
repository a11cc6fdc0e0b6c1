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


def test_host_table_shares_the_cpu_table():
    """host_table() is a numpy view of req_to_token: writes through either show in the other, and
    a replaced table gets a new view."""
    pool = ReqToTokenPool(size=2, max_context_len=8, device="cpu")
    host = pool.host_table()
    assert host is not None and host.shape == (2, 8) and pool.host_table() is host
    host[[0, 1], [3, 5]] = [7, 9]
    assert pool.req_to_token[0, 3] == 7 and pool.req_to_token[1, 5] == 9
    pool.req_to_token[1, 0] = 4
    assert host[1, 0] == 4
    pool.req_to_token = torch.zeros(2, 8, dtype=torch.int32)
    assert pool.host_table() is not host and pool.host_table()[1, 0] == 0
