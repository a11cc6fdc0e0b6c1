"""HiRadixCache across its two tiers (device pool L1, host tier L2), driven like the scheduler:
match, load back, lock, allocate, write KV, cache the request. The KV written for a position is a
function of the whole prefix up to it, so a load-back that brings the wrong bytes (or none) shows
as a KV mismatch, not only as wrong bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch
from cache_fakes import FakeReq

from radixserve.mem_cache import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.hiradix_cache import HiRadixCache, build_hiradix_cache
from radixserve.mem_cache.host_pool import host_pool_size

POLICIES = ("write_through", "write_through_selective", "write_back")


def expected_kv(tokens: list[int]) -> torch.Tensor:
    """[len(tokens)] the value every test writes for each position: a hash of the prefix."""
    out, h = [], 0
    for i, t in enumerate(tokens):
        h = (h * 31 + t * (i + 1)) % 65521
        out.append(float(h))
    return torch.tensor(out)


class TierEnv:
    def __init__(self, size=64, page_size=1, policy="write_through", layout="layer_first", ratio=2.0):
        self.size, self.ps = size, page_size
        self.alloc = TokenToKVPoolAllocator(size, page_size)
        self.rows = ReqToTokenPool(16, 512, "cpu")
        self.kv = MHATokenToKVPool(size, page_size, torch.float32, 2, 1, 2, "cpu")
        self.cache: HiRadixCache = build_hiradix_cache(
            self.rows, self.alloc, self.kv, ratio, 0, layout, policy, "lru"
        )

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        kv = values[:, None, None].expand(-1, 1, 2)  # [N, heads, head_dim]
        for layer in range(2):
            self.kv.set_kv_buffer(layer, slots, kv + layer, -kv - layer)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        k0 = self.kv.k_buffer[0][slots, 0, 0]
        v1 = self.kv.v_buffer[1][slots, 0, 1]
        assert torch.equal(v1, -k0 - 1), "K and V (or the layers) disagree"
        return k0

    def start(self, tokens: list[int]) -> FakeReq | None:
        """Admit a request: match, load its L2 part, lock, allocate and write the rest; None when
        the pool cannot hold it. Asserts the reused prefix holds the right KV."""
        req = FakeReq(list(tokens), fill_ids=list(tokens))
        m = self.cache.match_prefix(tokens[: len(tokens) - 1])
        prefix, node = m.device_indices, m.last_node
        if m.host_hit_length:
            loaded = self.cache.load_back(node, m.last_host_node)
            if loaded is not None:
                prefix, node = torch.cat([prefix, loaded[0]]), loaded[1]
        self.cache.inc_lock_ref(node)
        pre, n = len(prefix), len(tokens)
        need = -(-(n - pre) // self.ps) * self.ps
        if self.alloc.available_size() < need:
            self.cache.evict(need - self.alloc.available_size())
        last = int(prefix[-1]) if pre else -1
        new = self.alloc.alloc_extend([pre], [n], [last], n - pre)
        if new is None:
            self.cache.dec_lock_ref(node)
            return None
        assert torch.equal(self.read(prefix), expected_kv(tokens)[:pre]), "reused prefix has wrong KV"
        slots = torch.cat([prefix, new])
        self.write(new, expected_kv(tokens)[pre:])
        req.req_pool_idx = self.rows.alloc(1)[0]
        self.rows.req_to_token[req.req_pool_idx, :n] = slots.to(torch.int32)
        req.prefix_indices, req.last_node, req.kv_committed_len = prefix, node, n
        return req

    def serve(self, tokens: list[int]) -> FakeReq:
        req = self.start(tokens)
        assert req is not None
        self.cache.cache_finished_req(req)
        self.check()
        return req

    def abort(self, req: FakeReq) -> None:
        """What KVMemory.release_retracted does: free the slots past the locked prefix."""
        depth, node = 0, req.last_node
        while node is not None and node.parent is not None:
            depth += len(node.key)
            node = node.parent
        row = self.rows.req_to_token[req.req_pool_idx, depth : req.kv_committed_len].to(torch.int64)
        self.alloc.free(row)
        self.rows.free(req.req_pool_idx)
        self.cache.dec_lock_ref(req.last_node)

    def check(self, num_private: int = 0) -> None:
        total = self.cache.check_invariants()
        assert self.alloc.available_size() + total + num_private == self.size

    def node_of(self, tokens: list[int]):
        node = self.cache.root
        i = 0
        while i < len(tokens):
            node = node.children[self.cache._child_key(tokens, i, None)]
            i += len(node.key)
        return node


def seq(tag: int, n: int) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_evicted_prefix_is_demoted_and_loaded_back(page_size, policy):
    env = TierEnv(size=128, page_size=page_size, policy=policy)
    docs = [seq(t, 48) for t in range(1, 6)]  # 240 tokens of prefixes into a 128-token pool
    for d in docs:
        env.serve(d + [7])
        if policy == "write_through_selective":
            env.serve(d + [8])  # the second hit makes it worth a copy
    first = env.cache.match_prefix(docs[0] + [9])
    assert first.host_hit_length == 48 and len(first.device_indices) == 0
    before = env.cache.mover.stats.load_back.tokens
    req = env.start(docs[0] + [9, 9])  # asserts the loaded prefix holds docs[0]'s KV
    assert req is not None and len(req.prefix_indices) == 48
    assert env.cache.mover.stats.load_back.tokens - before == 48
    assert env.cache.host_hit_tokens >= 48
    env.cache.cache_finished_req(req)
    env.check()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_layouts_round_trip(layout):
    env = TierEnv(size=64, layout=layout)
    a, b = seq(1, 40), seq(2, 40)
    env.serve(a + [1])
    env.serve(b + [1])  # evicts most of a
    env.serve(a + [2])  # loads a back: KV checked
    assert env.cache.mover.stats.load_back.tokens > 0


def test_write_policies_decide_when_kv_is_copied():
    a = seq(1, 8)
    through = TierEnv(policy="write_through")
    through.serve(a + [1])
    assert through.node_of(a).host_value is not None  # copied when cached

    back = TierEnv(policy="write_back")
    back.serve(a + [1])
    assert back.node_of(a).host_value is None and back.cache.mover.stats.backup.tokens == 0
    back.cache.evict(back.size)
    assert back.node_of(a).value is None and back.node_of(a).host_value is not None  # copied on eviction
    assert back.cache.mover.stats.backup.tokens == 9

    selective = TierEnv(policy="write_through_selective")
    selective.serve(a + [1])
    assert selective.node_of(a).host_value is None  # one hit: not yet
    selective.serve(a + [2])
    assert selective.node_of(a).host_value is not None  # hit twice: copied
    selective.cache.evict(selective.size)
    assert selective.node_of(a).value is None  # demoted, not dropped
    assert selective.node_of(a).children == {}  # its once-hit tails [1], [2] had no copy: dropped


def test_uncopied_selective_leaf_is_dropped_not_demoted():
    env = TierEnv(policy="write_through_selective")
    a = seq(1, 8)
    env.serve(a)
    env.cache.evict(env.size)
    assert env.cache.root.children == {}
    assert env.cache.mover.stats.backup.tokens == 0
    env.check()


def test_locked_prefix_is_never_evicted_and_load_back_makes_room():
    env = TierEnv(size=64)
    a, b = seq(1, 40), seq(2, 40)
    env.serve(b + [1])
    env.serve(a + [1])  # b leaves L1 for L2
    ra = env.start(a + [2])  # a running request locks a
    assert ra is not None
    env.cache.evict(env.size)
    assert env.node_of(a).value is not None  # locked: stays on L1
    assert env.node_of(b).value is None and env.node_of(a + [1]).value is None
    env.check(num_private=1)
    env.cache.cache_finished_req(ra)
    rb = env.start(b + [2])  # loads b back (KV checked), evicting a to make room
    assert rb is not None and len(rb.prefix_indices) == 40
    assert env.node_of(a).value is None
    env.cache.cache_finished_req(rb)
    env.check()


def test_load_back_fails_cleanly_when_l1_is_all_locked():
    env = TierEnv(size=32)
    a, b = seq(1, 20), seq(2, 20)
    env.serve(a)
    env.cache.evict(env.size)
    rb = env.start(b)  # 20 of 32 slots locked by a running request
    assert rb is not None
    m = env.cache.match_prefix(a[:19])
    assert m.host_hit_length == 19
    node = m.last_node
    env.cache.inc_lock_ref(node)
    # 12 free slots, 19 needed, nothing evictable: no load, nothing changed.
    assert env.cache.load_back(node, m.last_host_node) is None
    env.cache.dec_lock_ref(node)
    env.check(num_private=20)
    env.abort(rb)
    env.check()


def test_device_eviction_is_lru_and_host_eviction_drops_oldest_host_leaf():
    env = TierEnv(size=48, ratio=2.0)  # L2: 96 tokens
    a, b, c = seq(1, 16), seq(2, 16), seq(3, 16)
    for s in (a, b, c):
        env.serve(s)
    env.cache.match_prefix(a)  # a is now the most recent
    env.cache.evict(16)
    assert env.node_of(b).value is None and env.node_of(a).value is not None
    for t in range(4, 9):  # 80 more tokens: L2 (96) cannot keep all 128 host copies
        env.serve(seq(t, 16))
    assert seq(2, 1)[0] not in env.cache.root.children  # b, least recently used, left L2 first
    env.check()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_load_with_aborts_leaks_no_slot_in_either_tier(page_size, policy):
    rnd = random.Random(page_size * 7 + len(policy))
    env = TierEnv(size=256, page_size=page_size, policy=policy, ratio=2.5)
    shared = [seq(t, 40) for t in range(1, 9)]
    live: list[FakeReq] = []
    for _ in range(150):
        if live and (len(live) > 3 or rnd.random() < 0.4):
            req = live.pop(rnd.randrange(len(live)))
            if rnd.random() < 0.3:
                env.abort(req)
            else:
                env.cache.cache_finished_req(req)
        else:
            tokens = rnd.choice(shared)[: rnd.randrange(10, 41)] + [rnd.randrange(1, 99) for _ in range(5)]
            req = env.start(tokens)
            if req is not None:
                live.append(req)
        env.cache.check_invariants()
    for req in live:
        env.cache.cache_finished_req(req)
    env.check()
    assert env.cache.protected_size() == 0
    assert env.cache.mover.stats.load_back.tokens > 0
    env.cache.reset()
    env.alloc.clear()
    assert env.cache.host_allocator.available_size() == env.cache.host_size()
    env.check()


def test_insert_over_a_host_only_path_revives_it_with_the_requests_slots():
    env = TierEnv(size=64)
    a = seq(1, 20)
    env.serve(a)
    env.cache.evict(env.size)
    assert env.node_of(a).value is None
    # A request that computed a again (no load) caches it: the node takes its slots, frees none.
    slots = env.alloc.alloc(20)
    env.write(slots, expected_kv(a))
    assert env.cache.insert(a, slots) == 20
    assert torch.equal(env.node_of(a).value, slots)
    env.check()


def test_reset_flushes_both_tiers_and_evict_stale_drops_l2():
    env = TierEnv(size=64)
    for t in range(1, 5):
        env.serve(seq(t, 20))
    assert env.cache.tier_stats()["host_used_tokens"] > 0
    env.cache.evict_stale()
    assert env.cache.root.children == {} and env.cache.tier_stats()["host_used_tokens"] == 0
    env.check()
    env.serve(seq(9, 20))
    env.cache.reset()
    env.alloc.clear()
    assert env.cache.host_allocator.available_size() == env.cache.host_size()
    assert env.cache.total_size() == 0


def test_host_tier_must_be_larger_than_the_device_pool():
    assert host_pool_size(100, 1, 64, 2.0, 0) == 200
    assert host_pool_size(100, 16, 3000, 2.0, 1) == 333_328  # 1 GB / 3000 B, cut to whole pages
    with pytest.raises(ValueError, match="larger than the device KV pool"):
        host_pool_size(100, 1, 64, 1.0, 0)
    with pytest.raises(ValueError, match="larger than the device KV pool"):
        host_pool_size(10**9, 1, 1000, 2.0, 1)
