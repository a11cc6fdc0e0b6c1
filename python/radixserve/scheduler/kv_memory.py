"""The scheduler's view of KV memory: the two pools plus the prefix cache, and how requests take and
give back their share. Allocation evicts from the prefix cache when the allocator runs short."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from radixserve.mem_cache.base_cache import BasePrefixCache
from radixserve.mem_cache.chunk_cache import ChunkCache

if TYPE_CHECKING:
    from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
    from radixserve.mem_cache.memory_pool import ReqToTokenPool
    from radixserve.scheduler.req import Req

logger = logging.getLogger(__name__)


class KVMemory:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree_cache: BasePrefixCache,
        page_size: int,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = page_size
        self.total_tokens = allocator.size

    # ------------------------------------------------------------------ sizes
    def available_size(self) -> int:
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        return self.tree_cache.evictable_size()

    def num_used_tokens(self) -> int:
        """Tokens held by requests or locked in the cache (not reclaimable right now)."""
        return self.total_tokens - self.available_size() - self.evictable_size()

    def token_usage(self) -> float:
        return self.num_used_tokens() / self.total_tokens

    def ceil_paged(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) * self.page_size

    # ------------------------------------------------------------------ allocation
    def _ensure_available(self, num_tokens: int) -> None:
        short = num_tokens - self.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    def alloc_rows(self, num_reqs: int) -> list[int]:
        rows = self.req_to_token_pool.alloc(num_reqs)
        if rows is None:
            raise RuntimeError(
                f"ReqToTokenPool out of rows ({num_reqs} wanted, "
                f"{self.req_to_token_pool.available_size()} free): admission should have prevented this"
            )
        return rows

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_loc: list[int], extend_num_tokens: int
    ) -> torch.Tensor:
        # A request continuing a partly filled page needs no new page for its first tokens, but one
        # extra page per request is the most paging can add, so this reserve always suffices.
        self._ensure_available(extend_num_tokens + len(seq_lens) * (self.page_size - 1))
        out = self.allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)
        if out is None:
            raise RuntimeError(
                f"Prefill out of memory: {extend_num_tokens} tokens wanted, {self.available_size()} free "
                f"after evicting; admission should have prevented this"
            )
        return out  # [extend_num_tokens] int64

    def alloc_decode(self, seq_lens: list[int], last_loc: list[int]) -> torch.Tensor:
        self._ensure_available(self.decode_tokens_needed(seq_lens))
        out = self.allocator.alloc_decode(seq_lens, last_loc)
        if out is None:
            raise RuntimeError("Decode out of memory: check_decode_mem should have prevented this")
        return out  # [bs] int64

    def decode_tokens_needed(self, seq_lens: list[int]) -> int:
        """Slots the next decode step takes: a new page only where the new position starts one."""
        if self.page_size == 1:
            return len(seq_lens)
        return sum(1 for s in seq_lens if (s - 1) % self.page_size == 0) * self.page_size

    def can_alloc(self, num_tokens: int) -> bool:
        """Evict as needed; True when `num_tokens` slots are free."""
        self._ensure_available(num_tokens)
        return self.available_size() >= num_tokens

    def can_decode(self, seq_lens: list[int]) -> bool:
        """Evict as needed; True when the next decode step of these sequences fits."""
        need = self.decode_tokens_needed(seq_lens)
        self._ensure_available(need)
        return self.available_size() >= need

    # ------------------------------------------------------------------ release
    def row_slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        """[end - start] int64 KV slots of positions start..end-1 of the request's row."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end]
        return row.to(device="cpu", dtype=torch.int64)

    def release_finished(self, req: Req) -> None:
        """Hand a finished request's KV to the prefix cache (which frees what it does not keep)."""
        self.tree_cache.cache_finished_req(req)
        self._forget(req)

    def release_retracted(self, req: Req) -> None:
        """Free what a retracted/preempted request holds beyond the cached prefix, without inserting
        its newer KV: a forward still in flight may be computing it from a row about to be reused."""
        slots = self.row_slots(req, self._tree_owned_len(req), req.kv_committed_len)
        if slots.numel():
            self.allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        self.tree_cache.dec_lock_ref(req.last_node)
        self._forget(req)

    def _tree_owned_len(self, req: Req) -> int:
        """Leading positions of the request's row that hold the cache's slots: the depth of its
        locked node (prefix_indices may extend past it with slots the request still owns)."""
        if isinstance(self.tree_cache, ChunkCache):
            return 0
        depth, node = 0, req.last_node
        while node is not None and node.parent is not None:
            depth += len(node.key)
            node = node.parent
        return depth

    @staticmethod
    def _forget(req: Req) -> None:
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)
        req.kv_committed_len = 0
        req.already_computed = 0

    # ------------------------------------------------------------------ maintenance
    def check_leak(self) -> str | None:
        """With no request alive every slot is free or in the cache and every row is free."""
        available, evictable = self.available_size(), self.evictable_size()
        protected = self.tree_cache.protected_size()
        problems = []
        if available + evictable + protected != self.total_tokens:
            problems.append(
                f"token leak: available={available} + evictable={evictable} + protected={protected} "
                f"!= total={self.total_tokens}"
            )
        if protected != 0:
            problems.append(f"{protected} cached tokens still locked with no request alive")
        rows_free = self.req_to_token_pool.available_size()
        if rows_free != self.req_to_token_pool.size:
            problems.append(f"request-row leak: {rows_free} of {self.req_to_token_pool.size} rows free")
        try:
            self.tree_cache.check_invariants()
        except AssertionError as exc:
            problems.append(f"prefix cache invariant broken: {exc}")
        return "; ".join(problems) if problems else None

    def flush(self) -> None:
        """Drop the prefix cache and reset both pools; only valid with no request alive."""
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()
