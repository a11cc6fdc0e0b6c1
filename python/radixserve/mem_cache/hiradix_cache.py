"""HiRadixCache: the radix cache over two tiers, the device KV pool (L1) and a host tier (L2).

A node's KV is on L1 (``value``), on L2 (``host_value``) or on both. Invariants:

- L1 is prefix-closed: a node on L1 has its parent on L1, so a match's device part is a prefix of
  its path and its host-only part is the rest (``match_prefix`` returns both).
- Only L1 nodes are locked (a request locks its matched device path), so tokens counted as
  evictable / protected are L1 tokens, exactly as in RadixCache; host-only nodes are never locked.
- Every non-root node is on at least one tier.

When a node gets its L2 copy depends on --hicache-write-policy: write_through copies a node when
it is cached (hit_count >= 1), write_through_selective once it has been hit twice (SGLang's
threshold), write_back only when L1 evicts it. Evicting an L1 node that has a copy just frees its
device slots (it is *demoted*); one without a copy is copied first under write_back, else dropped
(with any L2-only descendants, which only write_back can leave under an uncopied node, and only
when L2 is full). L2 evicts L2-only leaves, least recently used first. A match reaching into L2 is loaded back by ``load_back``
(the prefill adder calls it when it admits the request) in one batch per request.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Hashable, Sequence

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_cache import MatchResult, empty_indices
from radixserve.mem_cache.hicache_mover import HiCacheMover
from radixserve.mem_cache.host_pool import HostKVPool, host_pool_size
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode, _check

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiRadixCache(RadixCache):
    is_hierarchical = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        mover: HiCacheMover,
        page_size: int = 1,
        eviction_policy: str = "lru",
        write_policy: str = "write_through",
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.mover = mover
        self.host_allocator = mover.host_pool.allocator
        self.write_policy = write_policy
        # Hits before a node is copied to L2 (write_back copies on eviction only).
        self.backup_threshold = 2 if write_policy == "write_through_selective" else 1
        self._copy_pending: list[TreeNode] = []  # an eviction round's victims awaiting their L2 copy
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy)

    def reset(self) -> None:
        """Drop both tiers: the host tier's slots belong to the tree alone, so they are freed here
        (the caller clears the device allocator, as for RadixCache)."""
        super().reset()
        self.host_allocator.clear()
        self._host_tokens = 0  # tokens with an L2 copy
        # Prefix tokens served from L2 (loaded back for admitted requests). Counted here, not per
        # match: the scheduler matches a waiting request again at every admission attempt.
        self.host_hit_tokens = 0

    def reset_counters(self) -> None:
        super().reset_counters()
        self.host_hit_tokens = 0

    # ------------------------------------------------------------------ tree edits

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after n tokens on both tiers; the upper node shares its state."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:n], None, parent, child.namespace)
        upper.value = None if child.value is None else child.value[:n]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        if child.hash_value is not None:
            pages = n // self.page_size
            upper.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count
        parent.children[self._child_key(child.key, 0, child.namespace)] = upper
        child.key = child.key[n:]
        if child.value is not None:
            child.value = child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0, child.namespace)] = child
        return upper

    def _remove_node(self, node: TreeNode) -> None:
        """Unlink a childless, unlocked node and free its host copy (its L1 slots, if any, are the
        caller's to free)."""
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[self._child_key(node.key, 0, node.namespace)]
        self._leaves.discard(node)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        if node.host_value is not None:
            self.host_allocator.free(node.host_value)
            self._host_tokens -= len(node.key)
            node.host_value = None

    # ------------------------------------------------------------------ match and insert

    def match_prefix(self, key: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached prefix on either tier: device_indices covers the L1 part; the L2-only
        rest (host_hit_length tokens, down to last_host_node) waits for load_back."""
        key = key.tolist() if isinstance(key, torch.Tensor) else list(key)
        nodes, deepest, matched = self._walk_nodes(key[: self._aligned(len(key))], namespace)
        on_device = [n for n in nodes if n.value is not None]  # a prefix of nodes (prefix-closed L1)
        last_device = on_device[-1] if on_device else self.root
        host_len = matched - sum(len(n.key) for n in on_device)
        self.query_tokens += len(key)
        self.hit_tokens += matched - host_len
        indices = torch.cat([n.value for n in on_device]) if on_device else empty_indices()
        return MatchResult(indices, last_device, host_len, deepest if host_len else last_device)

    def _insert_path(
        self, key: list[int], value: torch.Tensor, namespace: Hashable
    ) -> tuple[int, TreeNode, list[torch.Tensor]]:
        """RadixCache's insert across tiers: a path node found on L2 only takes the request's own
        slots as its L1 copy (the request computed that KV again), so they are not duplicates."""
        n = len(key)
        if value.numel() < n:
            raise ValueError(f"insert: {value.numel()} slots for {n} tokens")
        value = value[:n].to(device="cpu", dtype=torch.int64)
        nodes, node, i = self._walk_nodes(key, namespace)
        pos = 0
        for nd in nodes:
            if nd.value is None:  # parents first, so L1 stays prefix-closed
                nd.value = value[pos : pos + len(nd.key)].clone()
                self._evictable += len(nd.key)  # host-only nodes are never locked
            pos += len(nd.key)
        if i < n:
            node = self._add_leaf(node, key[i:], value[i:].clone(), namespace)
            node.hit_count = 1  # being cached counts as its first hit (write_through's threshold)
            nodes.append(node)
        if self.write_policy != "write_back":
            self._backup([nd for nd in nodes if nd.hit_count >= self.backup_threshold], set())
        return i, node, [nd.value for nd in nodes]

    # ------------------------------------------------------------------ tier moves

    def _backup(self, nodes: list[TreeNode], keep: set[TreeNode]) -> list[TreeNode]:
        """Give these L1 nodes an L2 copy, in one batch; stops when L2 is full even after evicting
        its unused leaves (except ``keep``). Returns the nodes copied."""
        todo = [nd for nd in nodes if nd.host_value is None and nd.value is not None]
        done: list[TreeNode] = []
        for nd in todo:
            slots = self._alloc_host(len(nd.key), keep)
            if slots is None:
                break
            nd.host_value = slots
            self._host_tokens += len(nd.key)
            done.append(nd)
        if done:
            self.mover.backup(torch.cat([nd.value for nd in done]), torch.cat([nd.host_value for nd in done]))
            self._on_backed_up(done)
        return done

    def _on_backed_up(self, nodes: list[TreeNode]) -> None:
        """These nodes just got their L2 copy (the L3 tier writes them on)."""

    def _alloc_host(self, num_tokens: int, keep: set[TreeNode]) -> torch.Tensor | None:
        short = num_tokens - self.host_allocator.available_size()
        if short > 0:
            self._evict_host(short, keep)
        return self.host_allocator.alloc(num_tokens)

    def _evict_host(self, num_tokens: int, keep: set[TreeNode]) -> int:
        """Drop L2-only leaves, least recently used first, until num_tokens host slots are free."""
        heap = [(n.last_access_time, n.id, n) for n in self._leaves if n.value is None and n not in keep]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += len(leaf.key)
            self._remove_node(leaf)
            if (
                parent is not self.root
                and parent.value is None
                and not parent.children
                and parent not in keep
            ):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def _device_leaves(self) -> list[TreeNode]:
        """L1 nodes with no child on L1: L1's eviction candidates."""
        return [
            n
            for n in self._nodes()
            if n.value is not None and all(c.value is None for c in n.children.values())
        ]

    def evict(self, num_tokens: int) -> int:
        return self._evict_device(num_tokens, set())

    def _evict_device(self, num_tokens: int, keep: set[TreeNode]) -> int:
        """Free L1 slots of unlocked L1 leaves, LRU/LFU first: demote those with an L2 copy (after
        one batched copy for those that need it), drop the others. ``keep``: L2-only nodes that L2
        eviction must spare (a load in progress)."""
        if num_tokens <= 0:
            return 0
        heap = [(self._priority(n), n.id, n) for n in self._device_leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed, victims = 0, []
        pending = set(keep)
        while freed < num_tokens and heap:
            _, _, nd = heapq.heappop(heap)
            if nd.host_value is None and self.write_policy == "write_back":
                self._backup_later(nd, pending)
            victims.append(nd)
            pending.add(nd)  # demoted below: L2 eviction must not take it before its copy
            freed += len(nd.key)
            self._evictable -= len(nd.key)
            parent = nd.parent
            if (
                parent is not self.root
                and parent.lock_ref == 0
                and all(c in pending or c.value is None for c in parent.children.values())
            ):
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        self._finish_eviction(victims)
        return freed

    def _backup_later(self, nd: TreeNode, pending: set[TreeNode]) -> None:
        """Reserve L2 slots for a victim; _finish_eviction copies all of a round's at once."""
        slots = self._alloc_host(len(nd.key), pending)
        if slots is not None:
            nd.host_value = slots
            self._host_tokens += len(nd.key)
            self._copy_pending.append(nd)

    def _finish_eviction(self, victims: list[TreeNode]) -> None:
        copies, self._copy_pending = self._copy_pending, []
        if copies:
            self.mover.backup(torch.cat([n.value for n in copies]), torch.cat([n.host_value for n in copies]))
            self._on_backed_up(copies)
        device_slots = [n.value for n in victims]
        # In pop order, children before parents: a dropped parent takes its L2-only subtree along.
        for nd in victims:
            nd.value = None
            if nd.host_value is None:
                self._drop_subtree(nd)
        self._free(*device_slots)

    def _drop_subtree(self, node: TreeNode) -> None:
        stack, order = [node], []
        while stack:
            nd = stack.pop()
            order.append(nd)
            stack.extend(nd.children.values())
        for nd in reversed(order):  # leaves first
            self._remove_node(nd)

    def load_back(
        self, last_node: TreeNode, last_host_node: TreeNode
    ) -> tuple[torch.Tensor, TreeNode] | None:
        """Bring the L2-only nodes from below last_node (on L1) down to last_host_node into L1, in
        one batch. Returns ([num_tokens] int64 new device slots, the new deepest L1 node), or None
        when L1 cannot make room (the request then computes those tokens)."""
        path: list[TreeNode] = []
        nd = last_host_node
        while nd is not last_node:
            assert nd is not None and nd.value is None and nd.host_value is not None
            path.append(nd)
            nd = nd.parent
        if not path:
            return None
        path.reverse()
        num_tokens = sum(len(n.key) for n in path)
        # Lock the L1 prefix so making room cannot evict it; keep the path itself on L2.
        self.inc_lock_ref(last_node)
        try:
            self._evict_device(num_tokens - self.token_to_kv_pool_allocator.available_size(), set(path))
            slots = self.token_to_kv_pool_allocator.alloc(num_tokens)
        finally:
            self.dec_lock_ref(last_node)
        if slots is None:
            return None
        self.mover.load_back(torch.cat([n.host_value for n in path]), slots)
        self.host_hit_tokens += num_tokens
        pos = 0
        for n in path:
            n.value = slots[pos : pos + len(n.key)]
            pos += len(n.key)
        self._evictable += num_tokens
        return slots, last_host_node

    def evict_stale(self) -> int:
        """New weights: drop every L2 copy and every unlocked L1 entry (all of it is stale)."""
        tops = [
            n
            for n in self._nodes()
            if n.value is None and (n.parent is self.root or n.parent.value is not None)
        ]
        for nd in tops:  # L2-only subtrees
            self._drop_subtree(nd)
        for nd in self._nodes():
            if nd.host_value is not None:
                self.host_allocator.free(nd.host_value)
                self._host_tokens -= len(nd.key)
                nd.host_value = None
        # No L2 copies and no L2-only children left: eviction now drops instead of copying out.
        policy, self.write_policy = self.write_policy, "write_through"
        try:
            return self._evict_device(self.evictable_size(), set())
        finally:
            self.write_policy = policy

    # ------------------------------------------------------------------ reporting and checks

    def host_size(self) -> int:
        return self.mover.host_pool.size

    def tier_stats(self) -> dict[str, object]:
        s = self.mover.stats
        return {
            "write_policy": self.write_policy,
            "mem_layout": self.mover.host_pool.layout,
            "device_tokens": self.token_to_kv_pool_allocator.size,
            "host_tokens": self.host_size(),
            "host_bytes": self.mover.host_pool.size_bytes(),
            "host_used_tokens": self._host_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            "backup_tokens": s.backup.tokens,
            "backup_bytes": s.backup.bytes,
            "backup_time_s": s.backup.time_s,
            "load_back_tokens": s.load_back.tokens,
            "load_back_bytes": s.load_back.bytes,
            "load_back_time_s": s.load_back.time_s,
        }

    def all_values(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if n.value is not None]
        return torch.cat(values) if values else empty_indices()

    def all_host_values(self) -> torch.Tensor:
        values = [n.host_value for n in self._nodes() if n.host_value is not None]
        return torch.cat(values) if values else empty_indices()

    def check_invariants(self) -> int:
        """RadixCache's checks on L1 plus: L1 prefix-closed, locks only on L1, every node on a
        tier, L2 slots owned once and the host allocator's count matching. Returns L1 tokens."""
        evictable = protected = host = 0
        for node in self._nodes():
            on_l1, on_l2 = node.value is not None, node.host_value is not None
            _check(on_l1 or on_l2, f"{node!r} is on no tier")
            _check(
                not on_l1 or node.parent is self.root or node.parent.value is not None, f"{node!r}: L1 gap"
            )
            _check(on_l1 or node.lock_ref == 0, f"{node!r} locked but not on L1")
            _check(not on_l1 or node.value.numel() == len(node.key), f"{node!r} L1 length mismatch")
            _check(not on_l2 or node.host_value.numel() == len(node.key), f"{node!r} L2 length mismatch")
            _check(len(node.key) % self.page_size == 0, f"{node!r} not page-aligned")
            host += len(node.key) if on_l2 else 0
            # The write-through policies copy a path parents first (and a parent is hit whenever
            # its child is), so L2-only nodes always hang below a node with an L2 copy.
            _check(
                self.write_policy == "write_back"
                or on_l2
                or all(c.value is not None for c in node.children.values()),
                f"{node!r} has L2-only children but no L2 copy",
            )
            if on_l1:
                evictable += len(node.key) if node.lock_ref == 0 else 0
                protected += len(node.key) if node.lock_ref else 0
        _check(evictable == self._evictable, f"evictable {self._evictable} != actual {evictable}")
        _check(protected == self._protected, f"protected {self._protected} != actual {protected}")
        _check(host == self._host_tokens, f"host tokens {self._host_tokens} != actual {host}")
        for slots, alloc, tier in (
            (self.all_values(), self.token_to_kv_pool_allocator, "L1"),
            (self.all_host_values(), self.host_allocator, "L2"),
        ):
            _check(torch.unique(slots).numel() == slots.numel(), f"an {tier} slot is owned by two nodes")
            _check(not bool(alloc.is_free_mask(slots).any()), f"the tree holds freed {tier} slots")
        free_host = self.host_allocator.available_size()
        _check(free_host + host == self.host_allocator.size, f"L2 leak: {free_host} free + {host} cached")
        return evictable + protected

    def pretty_print(self) -> str:
        lines = [f"HiRadixCache(L1={self.total_size()}, L2={self._host_tokens}, policy={self.write_policy})"]
        stack = [(c, 1) for c in self.root.children.values()]
        while stack:
            nd, depth = stack.pop()
            tiers = ("L1" if nd.value is not None else "") + ("L2" if nd.host_value is not None else "")
            lines.append(f"{'  ' * depth}{nd.key[:8]} len={len(nd.key)} lock={nd.lock_ref} {tiers}")
            stack.extend((c, depth + 1) for c in nd.children.values())
        text = "\n".join(lines)
        print(text)
        return text


def build_hiradix_cache(
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    device_pool: MHATokenToKVPool,
    ratio: float,
    size_gb: int,
    layout: str,
    write_policy: str,
    eviction_policy: str,
    make: Callable[..., HiRadixCache] | None = None,
) -> HiRadixCache:
    """The host tier sized by --hicache-ratio / --hicache-size, its mover and the tree over both
    (built by ``make``, HiRadixCache's signature, when given: the L3 tier's subclass)."""
    size = host_pool_size(
        allocator.size, allocator.page_size, device_pool_bytes_per_token(device_pool), ratio, size_gb
    )
    host_pool = HostKVPool(device_pool, size, layout)
    logger.info(
        "HiCache: device tier %d tokens, host tier %d tokens (%.2f GiB, %s), write policy %s",
        allocator.size,
        size,
        host_pool.size_bytes() / 2**30,
        layout,
        write_policy,
    )
    mover = HiCacheMover(host_pool)
    return (make or HiRadixCache)(
        req_to_token_pool, allocator, mover, allocator.page_size, eviction_policy, write_policy
    )


def device_pool_bytes_per_token(pool: MHATokenToKVPool) -> int:
    return MHATokenToKVPool.kv_bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
