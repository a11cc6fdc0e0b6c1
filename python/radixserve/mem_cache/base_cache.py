"""The prefix-cache interface shared by RadixCache and ChunkCache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from radixserve.mem_cache.memory_pool import ReqToTokenPool
    from radixserve.mem_cache.radix_cache import TreeNode


class ReqLike(Protocol):
    """The fields of a scheduler ``Req`` that ``cache_*_req`` read and write (duck-typed)."""

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    req_pool_idx: int | None
    prefix_indices: torch.Tensor | None
    last_node: Any
    kv_committed_len: int
    # The prefix cache's namespace: KV computed under one LoRA adapter (or from one request's
    # input_embeds) is its own.
    cache_namespace: Hashable


@dataclass(frozen=True)
class MatchResult:
    device_indices: torch.Tensor  # [prefix_len] int64 KV slots of the matched prefix
    last_node: TreeNode | None  # deepest matched node (lock it to protect the prefix)
    # HiCache: the matched tokens past device_indices whose KV is on the host tier only, and the
    # deepest node holding them (load_back brings them into the device pool before the prefill).
    host_hit_length: int = 0
    last_host_node: TreeNode | None = None


def empty_indices() -> torch.Tensor:
    """A [0] int64 slot tensor (the value of an empty prefix)."""
    return torch.empty(0, dtype=torch.int64)


class BasePrefixCache(ABC):
    """Maps token prefixes to KV slots; see docs/contracts.md (Memory)."""

    req_to_token_pool: ReqToTokenPool
    hit_tokens: int
    query_tokens: int
    # Whether matches can reach into a host tier (HiRadixCache): the scheduler then matches each
    # request again when admitting it, as loading another request's prefix may evict.
    is_hierarchical: bool = False

    @abstractmethod
    def match_prefix(self, key: list[int], namespace: Hashable = None) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, namespace: Hashable = None) -> int: ...

    @abstractmethod
    def cache_finished_req(self, req: ReqLike) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req: ReqLike) -> None: ...

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode | None) -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode | None) -> int: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def all_values(self) -> torch.Tensor:
        """Every KV slot the cache owns ([total_size] int64), for leak checks."""

    @abstractmethod
    def check_invariants(self) -> int:
        """Verify internal accounting (raise AssertionError if broken); return total cached tokens."""

    def load_back(
        self, last_node: TreeNode | None, last_host_node: TreeNode | None
    ) -> tuple[torch.Tensor, TreeNode] | None:
        """Bring a match's host-tier part (MatchResult.host_hit_length > 0) into the device pool:
        (its new [n] int64 device slots, the new deepest device node), or None when nothing was
        loaded. A single-tier cache never reports a host part."""
        return None

    def evict_stale(self) -> int:
        """Drop every cached entry nobody holds, from every tier (the weights changed: that KV is
        stale). Returns device tokens freed."""
        return self.evict(self.evictable_size())

    def weights_updated(self) -> None:
        """The model's weights changed (HiCache L3: stop matching pages computed with the old ones)."""
        return None

    def prefetch_step(self, waiting: list[Any], idle: bool) -> None:
        """Once per scheduling round, with the waiting queue (HiCache L3: start, poll and cancel
        the storage prefetches; idle: nothing else can run, so it may wait a little)."""
        return None

    def prefetch_ready(self, req: Any) -> bool:
        """Whether the prefetch policy lets this waiting request be admitted now."""
        return True

    def tier_stats(self) -> dict[str, object]:
        """Per-tier sizes and traffic for /get_server_info; empty for a single-tier cache."""
        return {}

    def pretty_print(self) -> str:
        text = f"{type(self).__name__}(total={self.total_size()})"
        print(text)
        return text

    def _row_slots(self, req: ReqLike) -> torch.Tensor:
        """[kv_committed_len] int64 slots of the request's written KV."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len]
        return row.to(device="cpu", dtype=torch.int64)

    def reset_counters(self) -> None:
        self.hit_tokens = 0
        self.query_tokens = 0
