"""cpu_alloc.zeros: zero-filled, writable CPU buffers whose pages arrive on first write."""

from __future__ import annotations

import resource

import pytest
import torch

from radixserve.mem_cache import cpu_alloc
from radixserve.mem_cache.memory_pool import MHATokenToKVPool


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_large_buffers_are_zero_writable_and_shaped(dtype: torch.dtype) -> None:
    shape = (1 << 14, 4, 32)  # 2 MiB at fp32: above LAZY_MIN_BYTES for every dtype here
    t = cpu_alloc.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[3, 1] = 1
    assert t.sum().item() == 32 and t[3, 1].all() and not t[4].any()


def test_small_buffers_are_ordinary_tensors() -> None:
    t = cpu_alloc.zeros((4, 8), torch.float32)
    assert not t.any() and t.untyped_storage().resizable()  # torch's own allocation


def test_pages_arrive_on_first_write() -> None:
    """A 256 MiB pool costs no resident memory until written; writing one row costs about a row."""
    before = _rss_bytes()
    pool = MHATokenToKVPool(1 << 20, 1, torch.float32, 2, 1, 32, "cpu")  # 2 layers x K/V x 128 MiB
    assert sum(pool.get_kv_size_bytes()) >= 256 << 20
    assert _rss_bytes() - before < 32 << 20
    pool.k_buffer[0][: 1 << 14].fill_(1.0)  # 2 MiB of one layer's K
    grown = _rss_bytes() - before
    assert 2 << 20 <= grown < 32 << 20
    assert not pool.v_buffer[1].any()  # reading untouched pages sees zeros
