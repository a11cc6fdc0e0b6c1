"""Radix-tree prefix cache: token prefix -> KV slots, with lock refs and LRU/LFU eviction.

Each edge holds a run of token ids (``key``) and the KV slots that hold them (``value``). A request
that matches a prefix reuses those slots and locks the path (``lock_ref``) so eviction cannot free
KV it is reading. Sizes are kept incrementally: every token in the tree is either *evictable*
(its node has lock_ref == 0) or *protected*; ``inc_lock_ref``/``dec_lock_ref`` move whole nodes
between the two as they walk to the root. With ``page_size > 1`` keys are cut to a page multiple
and nodes split only on page boundaries, so every node owns whole KV pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_cache import BasePrefixCache, MatchResult, ReqLike, empty_indices
from radixserve.mem_cache.memory_pool import ReqToTokenPool

# A logical clock is cheaper than time.monotonic() and never ties, so LRU order is exact.
_access_clock = itertools.count(1)
_node_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "key",
        "value",
        "children",
        "parent",
        "lock_ref",
        "last_access_time",
        "hit_count",
        "id",
        "namespace",
        "host_value",
        "hash_value",
    )

    def __init__(
        self,
        key: list[int] | None = None,
        value: torch.Tensor | None = None,
        parent: TreeNode | None = None,
        namespace: Hashable = None,
    ) -> None:
        self.key: list[int] = key if key is not None else []  # token ids of this edge
        # Whose KV this is (a LoRA adapter's id; None for the base model). Part of every child
        # key, so a walk in one namespace never enters another's nodes.
        self.namespace = namespace
        self.value: torch.Tensor = value if value is not None else empty_indices()  # [len(key)] int64
        self.children: dict[Hashable, TreeNode] = {}  # first token (or first page tuple) -> child
        self.parent = parent
        self.lock_ref = 0
        self.last_access_time = next(_access_clock)
        self.hit_count = 0
        self.id = next(_node_ids)
        # HiCache (hiradix_cache.py): the node's slots in the host tier, None while it has no copy
        # there; `value` is then None while the node is on the host tier only.
        self.host_value: torch.Tensor | None = None  # [len(key)] int64
        # HiCache L3 (storage_keys.py): the content keys of the node's pages, computed when needed.
        self.hash_value: list[str] | None = None

    def __repr__(self) -> str:
        head = self.key[:6]
        more = "..." if len(self.key) > 6 else ""
        return f"TreeNode(id={self.id}, key={head}{more}, len={len(self.key)}, lock={self.lock_ref})"


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        eviction_policy: str = "lru",
    ) -> None:
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"eviction_policy must be 'lru' or 'lfu', got {eviction_policy!r}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree. Does not return slots to the allocator: like SGLang's flush, the
        caller clears the allocator and ReqToTokenPool too (only when no request is running)."""
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evictable
        self._evictable = 0
        self._protected = 0
        self._leaves: set[TreeNode] = set()  # non-root nodes without children (eviction candidates)
        self.reset_counters()

    # ------------------------------------------------------------------ key helpers

    def _child_key(self, key: Sequence[int], start: int, namespace: Hashable = None) -> Hashable:
        first = key[start] if self.page_size == 1 else tuple(key[start : start + self.page_size])
        # The base model's keys stay plain tokens; other namespaces pair theirs with the name.
        return first if namespace is None else (namespace, first)

    def _match_len(self, edge: list[int], key: list[int], start: int) -> int:
        """Common prefix length of ``edge`` and ``key[start:]``, a page multiple."""
        n = min(len(edge), len(key) - start)
        if edge[:n] == key[start : start + n]:  # whole-slice compare runs in C: the common case
            return n
        ps = self.page_size
        i = 0
        while i < n and edge[i : i + ps] == key[start + i : start + i + ps]:
            i += ps
        return i

    def _aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    @staticmethod
    def _touch(node: TreeNode) -> None:
        node.last_access_time = next(_access_clock)
        node.hit_count += 1

    # ------------------------------------------------------------------ tree edits

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after n tokens; return the new upper node (same locks and stats)."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent, child.namespace)
        upper.lock_ref = child.lock_ref  # every lock through child also passes through upper
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count
        assert child.parent is not None
        child.parent.children[self._child_key(child.key, 0, child.namespace)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0, child.namespace)] = child
        return upper

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, namespace: Hashable
    ) -> TreeNode:
        leaf = TreeNode(key, value, parent, namespace)
        parent.children[self._child_key(key, 0, namespace)] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._evictable += len(key)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[self._child_key(leaf.key, 0, leaf.namespace)]
        self._leaves.discard(leaf)
        self._evictable -= len(leaf.key)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        return parent

    def _walk(self, key: list[int], namespace: Hashable) -> tuple[list[torch.Tensor], TreeNode, int]:
        """Follow ``key`` (already page-aligned) from the root, splitting the last edge if the match
        ends inside it. Returns (slot tensors along the path, deepest node, matched length)."""
        nodes, node, i = self._walk_nodes(key, namespace)
        return [n.value for n in nodes], node, i

    def _walk_nodes(self, key: list[int], namespace: Hashable) -> tuple[list[TreeNode], TreeNode, int]:
        """As _walk, with the nodes along the path instead of their slots."""
        node, i, nodes = self.root, 0, []
        while i < len(key):
            child = node.children.get(self._child_key(key, i, namespace))
            if child is None:
                break
            self._touch(child)
            n = self._match_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            nodes.append(child)
            node, i = child, i + n
        return nodes, node, i

    # ------------------------------------------------------------------ public API

    def match_prefix(self, key: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached prefix of ``key`` (cut to a page multiple) among the prefixes cached in
        ``namespace`` (a LoRA adapter's id, None for the base model). Counts toward hit_tokens."""
        key = key.tolist() if isinstance(key, torch.Tensor) else list(key)
        values, node, matched = self._walk(key[: self._aligned(len(key))], namespace)
        self.query_tokens += len(key)
        self.hit_tokens += matched
        indices = torch.cat(values) if values else empty_indices()
        return MatchResult(device_indices=indices, last_node=node)

    def insert(self, key: Sequence[int], value: torch.Tensor, namespace: Hashable = None) -> int:
        """Cache ``key`` -> ``value`` slots (both cut to a page multiple) in ``namespace``.

        Returns how many leading tokens were already cached; the caller still owns value[:that]
        (now duplicates to free) while the tree takes ownership of the rest.
        """
        key = key.tolist() if isinstance(key, torch.Tensor) else list(key)
        return self._insert_path(key[: self._aligned(len(key))], value, namespace)[0]

    def _insert_path(
        self, key: list[int], value: torch.Tensor, namespace: Hashable
    ) -> tuple[int, TreeNode, list[torch.Tensor]]:
        """Insert an aligned key. Returns (length already cached, deepest node of the key's path,
        the tree's slot tensors along that path, covering all of key)."""
        n = len(key)
        if value.numel() < n:
            raise ValueError(f"insert: {value.numel()} slots for {n} tokens")
        value = value[:n].to(device="cpu", dtype=torch.int64)
        path, node, i = self._walk(key, namespace)
        if i < n:  # the rest of the key is new: one leaf holds it
            node = self._add_leaf(node, key[i:], value[i:].clone(), namespace)
            path.append(node.value)
        return i, node, path

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock the path root..node; returns the change in evictable_size (<= 0)."""
        delta = 0
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Unlock the path root..node; returns the change in evictable_size (>= 0)."""
        delta = 0
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on an unlocked node {node!r}: unbalanced lock")
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def _priority(self, node: TreeNode) -> tuple[int, ...]:
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access_time)
        return (node.last_access_time,)

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently (or frequently) used first, until at least
        ``num_tokens`` tokens are freed or nothing evictable is left. Returns tokens freed."""
        if num_tokens <= 0:
            return 0
        heap = [(self._priority(n), n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed, slots = 0, []
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            slots.append(leaf.value)
            freed += len(leaf.key)
            parent = self._remove_leaf(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        if slots:
            self.token_to_kv_pool_allocator.free(torch.cat(slots))
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ------------------------------------------------------------------ request hooks

    def _cache_tokens(
        self, token_ids: list[int], kv: torch.Tensor, namespace: Hashable
    ) -> tuple[int, TreeNode, torch.Tensor]:
        """Insert the page-aligned part of ``token_ids`` -> ``kv`` and free the request's slots that
        duplicate ones already cached. Returns (tokens now cached, their last node, tree slots
        [that many] int64)."""
        if bool(self.token_to_kv_pool_allocator.is_free_mask(kv).any()):
            raise RuntimeError(
                "request row points at freed KV slots: was its prefix evicted while unlocked, "
                "or its KV freed twice?"
            )
        # token_ids may be shorter than the written KV (e.g. fill_ids not yet extended with decoded
        # tokens): only what has a token id is cached; the rest stays the request's own tail.
        aligned = self._aligned(min(len(token_ids), kv.numel()))
        prefix_len, node, path = self._insert_path(token_ids[:aligned], kv, namespace)
        tree_slots = torch.cat(path) if path else empty_indices()  # [aligned]
        # Where the row already holds the tree's slot the KV is shared (matched earlier); elsewhere
        # in the already-cached range the request computed its own copy, which is now redundant.
        dup = kv[:prefix_len] != tree_slots[:prefix_len]
        self._free(kv[:prefix_len][dup])
        return aligned, node, tree_slots

    def _free(self, *parts: torch.Tensor) -> None:
        parts = tuple(p for p in parts if p.numel())
        if parts:
            self.token_to_kv_pool_allocator.free(torch.cat(parts))

    def cache_finished_req(self, req: ReqLike) -> None:
        """Cache (origin_input_ids + output_ids)[:kv_committed_len], free the duplicate slots and the
        unaligned tail, free the request's row and drop its lock."""
        kv = self._row_slots(req)
        token_ids = (req.origin_input_ids + req.output_ids)[: req.kv_committed_len]
        aligned, _, _ = self._cache_tokens(token_ids, kv, req.cache_namespace)
        self._free(kv[aligned:])
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: ReqLike) -> None:
        """Cache fill_ids[:kv_committed_len] so others can share it, point the request's row at the
        cached slots, move its lock to the new last node, and keep the unaligned tail private."""
        kv = self._row_slots(req)
        fill = list(req.fill_ids[: req.kv_committed_len])
        aligned, new_node, tree_slots = self._cache_tokens(fill, kv, req.cache_namespace)
        if not torch.equal(kv[:aligned], tree_slots):
            table = self.req_to_token_pool.req_to_token
            table[req.req_pool_idx, :aligned] = tree_slots.to(device=table.device, dtype=table.dtype)
        # Lock the new path before unlocking the old one so the shared part never looks evictable.
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([tree_slots, kv[aligned:]])
        req.last_node = new_node

    # ------------------------------------------------------------------ debugging

    def _nodes(self) -> list[TreeNode]:
        """All non-root nodes, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_values(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else empty_indices()

    def check_invariants(self) -> int:
        """Full walk verifying sizes, lock accounting, leaf set and slot ownership. Returns the
        total cached tokens. Raises AssertionError on the first broken invariant."""
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        for node in [self.root, *self._nodes()]:
            child_locks = 0
            for k, child in node.children.items():
                _check(child.parent is node, f"{child!r} has a wrong parent")
                _check(
                    k == self._child_key(child.key, 0, child.namespace), f"{child!r} filed under key {k!r}"
                )
                _check(
                    node is self.root or child.namespace == node.namespace, f"{child!r} left its namespace"
                )
                _check(len(child.key) == child.value.numel() > 0, f"{child!r} key/value length mismatch")
                _check(len(child.key) % self.page_size == 0, f"{child!r} not page-aligned")
                child_locks += child.lock_ref
            if node is self.root:
                continue
            _check(node.lock_ref >= child_locks, f"{node!r} lock_ref below its children's sum")
            if node.lock_ref == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
            if not node.children:
                leaves.add(node)
        _check(evictable == self._evictable, f"evictable {self._evictable} != actual {evictable}")
        _check(protected == self._protected, f"protected {self._protected} != actual {protected}")
        _check(leaves == self._leaves, "leaf set out of date")
        slots = self.all_values()
        _check(torch.unique(slots).numel() == slots.numel(), "a KV slot is owned by two nodes")
        _check(bool((slots >= self.page_size).all()), "a node holds a slot of the padding page 0")
        free = self.token_to_kv_pool_allocator.is_free_mask(slots)
        _check(not bool(free.any()), f"tree holds freed slots {slots[free][:8].tolist()}")
        return evictable + protected

    def pretty_print(self) -> str:
        lines = [
            f"RadixCache(total={self.total_size()}, evictable={self._evictable}, "
            f"protected={self._protected}, policy={self.eviction_policy})"
        ]

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(
                    f"{'  ' * depth}{child.key[:8]}{'...' if len(child.key) > 8 else ''} "
                    f"len={len(child.key)} lock={child.lock_ref} t={child.last_access_time} "
                    f"slots={child.value[:8].tolist()}"
                )
                visit(child, depth + 1)

        visit(self.root, 1)
        text = "\n".join(lines)
        print(text)
        return text


def _check(cond: bool, msg: str) -> None:
    # An explicit raise rather than `assert`, so `python -O` cannot skip the checks.
    if not cond:
        raise AssertionError(msg)
