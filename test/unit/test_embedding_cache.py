"""EmbeddingCache: LRU by image hash within a byte budget; counters for /get_server_info."""

from __future__ import annotations

import torch

from radixserve.multimodal.embedding_cache import EmbeddingCache, embedding_cache_of


def _emb(rows: int) -> torch.Tensor:
    return torch.ones(rows, 4)  # rows * 16 bytes


def test_lru_eviction_within_the_budget() -> None:
    cache = EmbeddingCache(capacity_bytes=3 * 16)
    cache.put(1, _emb(1))
    cache.put(2, _emb(1))
    cache.put(3, _emb(1))
    assert cache.get(1) is not None  # 1 is now the most recent: 2 goes first
    cache.put(4, _emb(1))
    assert cache.get(2) is None and cache.get(3) is not None and cache.get(4) is not None
    assert cache.stats() == {
        "capacity_bytes": 48,
        "size_bytes": 48,
        "num_entries": 3,
        "num_hits": 3,
        "num_misses": 1,
        "num_evictions": 1,
    }
    cache.put(5, _emb(2))  # needs two slots: the two least recent (1, then 3) go
    assert cache.get(1) is None and cache.get(3) is None and cache.get(4) is not None
    assert cache.size_bytes == 48 and cache.num_evictions == 3


def test_an_embedding_larger_than_the_budget_is_not_kept() -> None:
    cache = EmbeddingCache(capacity_bytes=16)
    cache.put(1, _emb(1))
    cache.put(2, _emb(2))
    assert cache.get(2) is None and cache.get(1) is not None and cache.num_evictions == 0


def test_size_zero_turns_the_cache_off() -> None:
    assert embedding_cache_of(0) is None
    cache = embedding_cache_of(3)
    assert cache is not None and cache.capacity_bytes == 3 * 2**20
