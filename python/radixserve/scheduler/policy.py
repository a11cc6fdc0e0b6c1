"""SchedulePolicy: the order in which waiting requests are offered to the PrefillAdder (seed 001 §8.1,
seed 000 §6).

Cache-aware policies match every waiting request against the prefix cache first:
- lpm: longest cached prefix first (falls back to fcfs past 128 waiting requests, where matching
  every request each round costs more than it saves);
- dfs-weight: walk the cache tree depth-first, heavier subtrees (more waiting requests) first, so
  requests sharing a prefix run together.
Cache-agnostic: fcfs (queue order), lof (longest max_new_tokens first), random.
With priority scheduling, every policy orders by priority first (larger = more important), then by
its own key; fcfs then means priority, then arrival time.
"""

from __future__ import annotations

import random
from collections import defaultdict
from enum import Enum
from typing import Any

import torch

from radixserve.mem_cache.base_cache import BasePrefixCache
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.scheduler.req import Req


class CacheAwarePolicy(Enum):
    LPM = "lpm"
    DFS_WEIGHT = "dfs-weight"


class CacheAgnosticPolicy(Enum):
    FCFS = "fcfs"
    LOF = "lof"
    RANDOM = "random"


# Matching every waiting request against the tree is O(queue x prompt); past this many waiting
# requests lpm costs more than it saves and falls back to fcfs (seed 001 §8.1).
LPM_FALLBACK_QUEUE_LEN = 128
# In-batch prefix caching: a request with at most CHECK cached tokens whose prompt shares at least
# DEPRIORITIZE tokens with an earlier waiting request waits one round, so the earlier one caches the
# shared prefix first. The seeds name these thresholds without values; 32/32 are upstream SGLang's.
# The same holds against the request whose prompt is being chunked: the chunks it ran are cached,
# the rest of its prompt is not yet; a waiting request that would get at least DEPRIORITIZE more of
# its prompt from the chunked one's remaining chunks waits until they are cached too.
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32


def parse_policy(name: str, cache_aware_ok: bool) -> CacheAwarePolicy | CacheAgnosticPolicy:
    for enum in (CacheAwarePolicy, CacheAgnosticPolicy):
        try:
            policy = enum(name)
        except ValueError:
            continue
        # Without a radix cache there are no prefixes to be aware of.
        return policy if cache_aware_ok or enum is CacheAgnosticPolicy else CacheAgnosticPolicy.FCFS
    raise ValueError(f"Unknown schedule policy {name!r}")


class SchedulePolicy:
    def __init__(
        self, policy: str, tree_cache: BasePrefixCache, enable_priority_scheduling: bool, seed: int = 0
    ) -> None:
        self.tree_cache = tree_cache
        self.policy = parse_policy(policy, isinstance(tree_cache, RadixCache))
        self.enable_priority_scheduling = enable_priority_scheduling
        self.rng = random.Random(seed)
        self.waiting_queue_radix_tree: RadixCache | None = None
        # ids of requests that wait this round for a sibling to cache their shared prefix
        self.deprioritized: set[int] = set()
        if isinstance(tree_cache, RadixCache):
            # Only insert/match are used: this tree never allocates or frees KV slots.
            self.waiting_queue_radix_tree = RadixCache(
                tree_cache.req_to_token_pool, tree_cache.token_to_kv_pool_allocator, page_size=1
            )

    def active_policy(self, waiting_queue: list[Req]) -> CacheAwarePolicy | CacheAgnosticPolicy:
        if self.policy == CacheAwarePolicy.LPM and len(waiting_queue) > LPM_FALLBACK_QUEUE_LEN:
            return CacheAgnosticPolicy.FCFS
        return self.policy

    def calc_priority(self, waiting_queue: list[Req], chunked_req: Req | None = None) -> bool:
        """Sort waiting_queue in place; True when each request's prefix was matched already.
        `chunked_req`: the request whose prompt is being chunked (not in the queue), if any."""
        policy = self.active_policy(waiting_queue)
        self.deprioritized = set()
        if isinstance(policy, CacheAwarePolicy):
            deprioritized = self.deprioritized = self._compute_prefix_matches(
                waiting_queue, policy, chunked_req
            )
            if policy == CacheAwarePolicy.LPM:
                waiting_queue.sort(key=lambda r: (id(r) in deprioritized, -len(r.prefix_indices)))
            else:
                self._sort_by_dfs_weight(waiting_queue)
        elif policy == CacheAgnosticPolicy.LOF:
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == CacheAgnosticPolicy.RANDOM:
            self.rng.shuffle(waiting_queue)
        elif self.enable_priority_scheduling:  # fcfs with priorities: arrival within a priority
            waiting_queue.sort(key=lambda r: r.times.received)
        if self.enable_priority_scheduling:
            waiting_queue.sort(key=lambda r: -r.priority)  # stable: keeps the policy's order inside
        return isinstance(policy, CacheAwarePolicy)

    def _compute_prefix_matches(
        self, waiting_queue: list[Req], policy: CacheAwarePolicy, chunked_req: Req | None
    ) -> set[int]:
        """Match every request; return ids of requests deprioritized by in-batch prefix caching."""
        deprioritized: set[int] = set()
        tree = self.waiting_queue_radix_tree
        if tree is not None:
            tree.reset()
        chunking = chunked_req.origin_input_ids if chunked_req is not None else None
        for r in waiting_queue:
            r.init_next_round_input(self.tree_cache)
            if policy != CacheAwarePolicy.LPM or tree is None:
                continue
            cached = len(r.prefix_indices)
            if chunking is not None and _common_len(chunking, r.fill_ids) - cached >= (
                IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
            ):
                deprioritized.add(id(r))  # the chunked request is computing the rest of its prefix
                continue
            if cached <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                key = r.fill_ids
                in_batch = len(tree.match_prefix(key, r.lora_id).device_indices)
                if in_batch >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                    deprioritized.add(id(r))
                else:
                    tree.insert(key, torch.zeros(len(key), dtype=torch.int64), r.lora_id)
        return deprioritized

    def _sort_by_dfs_weight(self, waiting_queue: list[Req]) -> None:
        assert isinstance(self.tree_cache, RadixCache)
        root = self.tree_cache.root
        node_reqs: dict[Any, list[Req]] = defaultdict(list)
        for r in waiting_queue:
            node_reqs[r.last_node if r.last_node is not None else root].append(r)
        weight = _subtree_weights(root, {node: len(reqs) for node, reqs in node_reqs.items()})
        ordered: list[Req] = []
        stack = [root]
        while stack:  # depth-first, heaviest child first
            node = stack.pop()
            ordered.extend(node_reqs.get(node, ()))
            children = sorted(node.children.values(), key=lambda c: weight.get(c, 0))
            stack.extend(c for c in children if weight.get(c, 0) > 0)
        waiting_queue[:] = ordered


def _common_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # whole-slice compare runs in C: the common case for a shared prefix
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _subtree_weights(root: Any, own: dict[Any, int]) -> dict[Any, int]:  # noqa: ANN401 - TreeNode
    """Waiting requests at or below each node."""
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    weight: dict[Any, int] = {}
    for node in reversed(order):  # children before parents
        weight[node] = own.get(node, 0) + sum(weight[c] for c in node.children.values())
    return weight
