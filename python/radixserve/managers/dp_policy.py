"""Which data-parallel replica gets a request: the DataParallelController's dispatch methods.

Pure bookkeeping, no sockets (the controller process in data_parallel_controller.py owns those), so
every method is unit-tested on fixed load sequences:

- `round_robin`: replicas in turn.
- `shortest_queue`: the seed's DPBudget TOTAL_REQUESTS (argmin of running + waiting requests).
- `minimum_tokens`: DPBudget TOTAL_TOKENS (min by (tokens, requests)).
- `cache_aware`: the SGLang Model Gateway's policy over an approximate radix tree of the prompts
  sent to each replica (`CacheAwarePolicy`).

Loads come from the replicas' reports (`GetLoadReqOutput`, every --load-watch-interval s while
they change); between two reports every dispatch adds one request to its replica's count (the
seed's "heuristic increment"), so a burst does not all land on the replica that looked idlest.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from radixserve.server_args import LOAD_BALANCE_METHODS

# Tokens of prompt prefixes the approximate tree remembers per replica before it forgets the least
# recently used ones (the Gateway's --max-tree-size counts characters; this counts tokens).
DEFAULT_MAX_TREE_TOKENS = 1 << 20


class DPBudget:
    """Per-replica load: requests (running + waiting) and tokens (KV in use + waiting prompts)."""

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self.total_requests = [0] * dp_size
        self.total_tokens = [0] * dp_size

    def update(self, dp_rank: int, num_reqs: int, num_tokens: int) -> None:
        """A replica's report replaces what was estimated since its previous one."""
        self.total_requests[dp_rank] = num_reqs
        self.total_tokens[dp_rank] = num_tokens

    def shortest_queue(self) -> int:
        return self.total_requests.index(min(self.total_requests))

    def minimum_tokens(self) -> int:
        return min(range(self.dp_size), key=lambda i: (self.total_tokens[i], self.total_requests[i]))

    def count(self, dp_rank: int) -> None:
        self.total_requests[dp_rank] += 1  # the heuristic increment, until the next report


@dataclass
class _Node:
    key: list[int] = field(default_factory=list)  # the edge's tokens, from the parent to this node
    children: dict[int, _Node] = field(default_factory=dict)
    tenants: dict[int, int] = field(default_factory=dict)  # replica -> last access (a counter)


class ApproxRadixTree:
    """The prompts (token ids) sent to each replica, shared in one radix tree.

    A node lists the replicas ("tenants") that were sent its prefix; a replica listed at a node is
    listed at every ancestor. It approximates each replica's prefix cache: it never sees the
    replica evict, so it forgets a replica's least recently used prefixes once the replica holds
    more than `max_tokens`, and all of them when the replicas' caches are flushed.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TREE_TOKENS) -> None:
        self.root = _Node()
        self.max_tokens = max_tokens
        self.sizes: dict[int, int] = {}  # replica -> tokens of the tree it is listed on
        self._clock = itertools.count(1)

    def clear(self) -> None:
        self.root = _Node()
        self.sizes.clear()

    def match(self, tokens: list[int]) -> dict[int, int]:
        """For each replica listed on the path of `tokens`: how many leading tokens it was sent."""
        matched: dict[int, int] = {}
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            common = _common_len(child.key, tokens, depth)
            for tenant in child.tenants:
                matched[tenant] = depth + common
            if common < len(child.key):
                break
            node, depth = child, depth + common
        return matched

    def insert(self, tokens: list[int], tenant: int) -> None:
        stamp = next(self._clock)
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(key=list(tokens[depth:]), tenants={tenant: stamp})
                node.children[tokens[depth]] = leaf
                self.sizes[tenant] = self.sizes.get(tenant, 0) + len(leaf.key)
                break
            common = _common_len(child.key, tokens, depth)
            if common < len(child.key):
                child = _split(node, child, common)
            if tenant not in child.tenants:
                self.sizes[tenant] = self.sizes.get(tenant, 0) + len(child.key)
            child.tenants[tenant] = stamp
            node, depth = child, depth + common
        if self.sizes.get(tenant, 0) > self.max_tokens:
            self._evict(tenant)

    def _evict(self, tenant: int) -> None:
        """Drop `tenant` from its least recently used leaves until it fits in max_tokens."""
        heap: list[tuple[int, int, _Node, _Node]] = []
        tie = itertools.count()
        for parent, node in _walk(self.root):
            if tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values()):
                heapq.heappush(heap, (node.tenants[tenant], next(tie), parent, node))
        while heap and self.sizes[tenant] > self.max_tokens:
            _, _, parent, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self.sizes[tenant] -= len(node.key)
            if not node.tenants and not node.children:
                del parent.children[node.key[0]]
            # The parent may now be one of the tenant's leaves (found again on the next eviction).


def _common_len(key: list[int], tokens: list[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start : start + n]:  # whole-slice compare runs in C: the common case
        return n
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


def _split(parent: _Node, child: _Node, at: int) -> _Node:
    """Cut `child`'s edge after `at` tokens; the new middle node keeps the child's tenants."""
    middle = _Node(key=child.key[:at], tenants=dict(child.tenants))
    child.key = child.key[at:]
    middle.children[child.key[0]] = child
    parent.children[middle.key[0]] = middle
    return middle


def _walk(root: _Node) -> list[tuple[_Node, _Node]]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            out.append((node, child))
            stack.append(child)
    return out


@dataclass(frozen=True)
class CacheAwareConfig:
    """The Gateway's thresholds (its defaults: 0.3, 64, 1.5)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


class CacheAwarePolicy:
    """The SGLang Model Gateway's cache_aware policy over replicas instead of workers.

    While the load is balanced, a request goes to the replica that was sent the longest prefix of
    it, if that prefix is at least `cache_threshold` of the prompt; otherwise (a cache miss) to
    the least loaded replica, ties to the one whose tree is smallest (most room for new prefixes).
    The load is imbalanced when the busiest replica has more than `balance_abs_threshold` requests
    over the idlest AND more than `balance_rel_threshold` times its load; then the least loaded
    replica gets the request whatever its cache. The prompt is recorded for the chosen replica.
    """

    def __init__(
        self, dp_size: int, config: CacheAwareConfig, max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS
    ):
        self.dp_size = dp_size
        self.config = config
        self.tree = ApproxRadixTree(max_tree_tokens)

    def is_imbalanced(self, loads: list[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.config.balance_abs_threshold and hi > lo * self.config.balance_rel_threshold

    def select(self, tokens: list[int], loads: list[int]) -> int:
        target = self._choose(tokens, loads)
        self.tree.insert(tokens, target)
        return target

    def _choose(self, tokens: list[int], loads: list[int]) -> int:
        least_loaded = min(range(self.dp_size), key=lambda i: (loads[i], self.tree.sizes.get(i, 0), i))
        if self.is_imbalanced(loads) or not tokens:
            return least_loaded
        matched = self.tree.match(tokens)
        if matched:
            best = max(matched, key=lambda i: (matched[i], -loads[i], -i))
            if matched[best] / len(tokens) >= self.config.cache_threshold:
                return best
        return least_loaded


class Dispatcher:
    """One of the four methods, behind `select(tokens) -> dp_rank`, fed by load reports."""

    def __init__(
        self,
        method: str,
        dp_size: int,
        cache_config: CacheAwareConfig | None = None,
        max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS,
    ) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method must be one of {LOAD_BALANCE_METHODS}, got {method!r}")
        self.method = method
        self.dp_size = dp_size
        self.budget = DPBudget(dp_size)
        self.cache_aware = (
            CacheAwarePolicy(dp_size, cache_config or CacheAwareConfig(), max_tree_tokens)
            if method == "cache_aware"
            else None
        )
        self._next = 0

    def on_load(self, dp_rank: int, num_reqs: int, num_tokens: int) -> None:
        self.budget.update(dp_rank, num_reqs, num_tokens)

    def on_flush(self) -> None:
        """Every replica's prefix cache was dropped: so is what the tree remembers."""
        if self.cache_aware is not None:
            self.cache_aware.tree.clear()

    def select(self, tokens: list[int]) -> int:
        # follow_bootstrap_room places requests by their room (the controller); one without a room
        # (a probe) goes round robin.
        if self.method in ("round_robin", "follow_bootstrap_room"):
            target = self._next
            self._next = (self._next + 1) % self.dp_size
        elif self.method == "shortest_queue":
            target = self.budget.shortest_queue()
        elif self.method == "minimum_tokens":
            target = self.budget.minimum_tokens()
        else:
            assert self.cache_aware is not None
            target = self.cache_aware.select(tokens, self.budget.total_requests)
        self.budget.count(target)
        return target

    def routed(self, dp_rank: int, tokens: list[int]) -> None:
        """A request that named its replica still counts toward its load (and its cache)."""
        self.budget.count(dp_rank)
        if self.cache_aware is not None:
            self.cache_aware.tree.insert(tokens, dp_rank)
