"""ChunkCache: the prefix cache used with --disable-radix-cache.

Nothing is shared between requests: matches are always empty and a finished request's KV goes
straight back to the allocator. It still supports chunked prefill: between chunks a request keeps
its own slots as ``prefix_indices`` so the next chunk extends them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_cache import BasePrefixCache, MatchResult, ReqLike, empty_indices
from radixserve.mem_cache.memory_pool import ReqToTokenPool

if TYPE_CHECKING:
    from radixserve.mem_cache.radix_cache import TreeNode


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.reset_counters()

    def reset(self) -> None:
        self.reset_counters()

    def match_prefix(self, key: Sequence[int], namespace: Hashable = None) -> MatchResult:
        self.query_tokens += len(key)
        return MatchResult(device_indices=empty_indices(), last_node=None)

    def insert(self, key: Sequence[int], value: torch.Tensor, namespace: Hashable = None) -> int:
        # Nothing is cached: the caller keeps ownership of every slot.
        return 0

    def cache_finished_req(self, req: ReqLike) -> None:
        """Free all the request's written KV slots and its row."""
        self.token_to_kv_pool_allocator.free(self._row_slots(req))
        self.req_to_token_pool.free(req.req_pool_idx)

    def cache_unfinished_req(self, req: ReqLike) -> None:
        """Keep the request's slots as its prefix for the next chunk."""
        req.prefix_indices = self._row_slots(req)

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_values(self) -> torch.Tensor:
        return empty_indices()

    def check_invariants(self) -> int:
        return 0
