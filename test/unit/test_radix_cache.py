"""RadixCache (and ChunkCache) against the allocator and ReqToTokenPool, driven like the scheduler."""

import random

import pytest
import torch
from cache_fakes import FakeReq

from radixserve.mem_cache import ChunkCache, RadixCache, ReqToTokenPool, TokenToKVPoolAllocator


class Env:
    """The three memory levels plus the scheduler-side steps that use them."""

    def __init__(self, size=64, page_size=1, policy="lru", max_reqs=8, ctx=256, chunk=False):
        self.size, self.ps = size, page_size
        self.alloc = TokenToKVPoolAllocator(size, page_size)
        self.pool = ReqToTokenPool(max_reqs, ctx, "cpu")
        cls = ChunkCache if chunk else RadixCache
        extra = {} if chunk else {"eviction_policy": policy}
        self.cache = cls(self.pool, self.alloc, page_size, **extra)

    def row(self, req) -> list[int]:
        return self.pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist()

    def _alloc_or_evict(self, fn, need: int):
        out = fn()
        if out is None:
            self.cache.evict(need + self.ps)
            out = fn()
        return out

    def prefill(self, req: FakeReq, end: int) -> bool:
        """Admit (first chunk) or continue a request up to origin_input_ids[:end]."""
        req.fill_ids = req.origin_input_ids[:end]
        if req.req_pool_idx is None:
            # the scheduler caps the match at len-1 and matches in the request's adapter namespace
            m = self.cache.match_prefix(req.fill_ids[: len(req.fill_ids) - 1], req.lora_id)
            req.prefix_indices, req.last_node = m.device_indices, m.last_node
            self.cache.inc_lock_ref(m.last_node)
            req.req_pool_idx = self.pool.alloc(1)[0]
            self.pool.req_to_token[req.req_pool_idx, : len(m.device_indices)] = m.device_indices.to(
                torch.int32
            )
        pre = len(req.prefix_indices)
        last = int(req.prefix_indices[-1]) if pre else -1
        ext = end - pre
        out = self._alloc_or_evict(lambda: self.alloc.alloc_extend([pre], [end], [last], ext), ext)
        if out is None:
            return False
        self.pool.req_to_token[req.req_pool_idx, pre:end] = out.to(torch.int32)
        req.kv_committed_len = end
        return True

    def decode(self, req: FakeReq, token: int) -> bool:
        """Write the KV of the last sampled token, then sample ``token``."""
        n = req.kv_committed_len
        last = int(self.pool.req_to_token[req.req_pool_idx, n - 1])
        out = self._alloc_or_evict(lambda: self.alloc.alloc_decode([n + 1], [last]), 1)
        if out is None:
            return False
        self.pool.req_to_token[req.req_pool_idx, n] = int(out[0])
        req.kv_committed_len = n + 1
        req.output_ids.append(token)
        return True

    def run_prompt(self, tokens: list[int], finish: bool = False, lora_id: str | None = None) -> FakeReq:
        req = FakeReq(list(tokens), lora_id=lora_id)
        assert self.prefill(req, len(tokens))
        if finish:
            self.cache.cache_finished_req(req)
        else:
            self.cache.cache_unfinished_req(req)
        return req

    def tree_pages(self) -> set[int]:
        return set((self.cache.all_values() // self.ps).tolist())

    def check_accounting(self, live: list[FakeReq]) -> None:
        """allocator free + tree + private pages of live requests == pool, with no overlap."""
        total = self.cache.check_invariants()
        assert total == self.cache.total_size()
        assert self.cache.evictable_size() + self.cache.protected_size() == total
        tree = self.tree_pages()
        assert len(tree) * self.ps == total
        private: set[int] = set()
        for r in live:
            pages = {s // self.ps for s in self.row(r)}
            private |= pages - tree
        assert not bool(
            self.alloc.is_free_mask(torch.tensor(sorted(private), dtype=torch.int64) * self.ps).any()
        )
        assert self.alloc.available_size() + (len(tree) + len(private)) * self.ps == self.size
        assert self.pool.available_size() == self.pool.size - len(live)


A, B, C, D, F, G, H = 1, 2, 3, 4, 6, 7, 8


def test_seed_004_worked_example():
    env = Env()
    ab = env.alloc.alloc(2)
    env.cache.insert([A, B], ab)  # "A, B" cached before R1 arrives
    r1 = env.run_prompt([A, B, C, D])
    s10, s11 = ab.tolist()
    row1 = env.row(r1)
    assert row1[:2] == [s10, s11]
    r2 = env.run_prompt([A, B, C, F])
    r3 = env.run_prompt([A, B, G, H])
    row2, row3 = env.row(r2), env.row(r3)
    assert row2[:3] == row1[:3] and row2[3] not in row1  # shares ABC, private F
    assert row3[:2] == [s10, s11] and not set(row3[2:]) & set(row1 + row2)  # shares AB
    assert len(set(row1 + row2 + row3)) == 7  # slots for A B C D F G H
    # Tree: AB -> {C -> {D, F}, GH}
    ab_node = env.cache.root.children[A]
    assert ab_node.key == [A, B] and sorted(ab_node.children) == [C, G]
    assert sorted(ab_node.children[C].children) == [D, F]
    assert ab_node.lock_ref == 3 and env.cache.protected_size() == 7
    env.check_accounting([r1, r2, r3])
    for r in (r1, r2, r3):
        env.cache.cache_finished_req(r)
    env.check_accounting([])
    assert env.cache.evictable_size() == 7 and env.cache.protected_size() == 0
    assert env.cache.evict(100) == 7
    assert env.alloc.available_size() == env.size


def test_match_splits_node_on_partial_match():
    env = Env()
    slots = env.alloc.alloc(5)
    assert env.cache.insert([1, 2, 3, 4, 5], slots) == 0
    m = env.cache.match_prefix([1, 2, 3, 9])
    assert m.device_indices.tolist() == slots[:3].tolist()
    assert m.last_node.key == [1, 2, 3] and list(m.last_node.children) == [4]
    assert m.last_node.children[4].value.tolist() == slots[3:].tolist()
    assert env.cache.check_invariants() == 5
    assert env.cache.match_prefix([]).device_indices.numel() == 0
    assert env.cache.match_prefix([9]).last_node is env.cache.root


def test_insert_returns_existing_prefix_len():
    env = Env()
    assert env.cache.insert([1, 2, 3], env.alloc.alloc(3)) == 0
    dup = env.alloc.alloc(5)
    assert env.cache.insert([1, 2, 3, 4, 5], dup) == 3  # caller still owns dup[:3]
    env.alloc.free(dup[:3])
    assert env.cache.insert([1, 2, 9], torch.cat([dup[:2], env.alloc.alloc(1)])) == 2
    assert env.cache.total_size() == 6
    assert env.cache.hit_tokens == 0 and env.cache.query_tokens == 0
    env.cache.match_prefix([1, 2, 3, 7])
    assert (env.cache.hit_tokens, env.cache.query_tokens) == (3, 4)
    env.cache.reset_counters()
    assert env.cache.hit_tokens == 0
    env.cache.check_invariants()


def test_lock_changes_evictable_and_protected():
    env = Env()
    env.cache.insert([1, 2, 3, 4, 5], env.alloc.alloc(5))
    m = env.cache.match_prefix([1, 2, 3])
    assert env.cache.inc_lock_ref(m.last_node) == -3
    assert (env.cache.evictable_size(), env.cache.protected_size()) == (2, 3)
    assert env.cache.inc_lock_ref(m.last_node) == 0  # already protected
    assert env.cache.evict(100) == 2  # only the unlocked leaf [4, 5]
    assert env.cache.dec_lock_ref(m.last_node) == 0
    assert env.cache.dec_lock_ref(m.last_node) == 3
    with pytest.raises(RuntimeError, match="unbalanced"):
        env.cache.dec_lock_ref(m.last_node)
    assert env.cache.evict(100) == 3
    assert env.alloc.available_size() == env.size
    assert env.cache.inc_lock_ref(None) == 0 and env.cache.inc_lock_ref(env.cache.root) == 0


def _remaining_first_tokens(cache: RadixCache) -> list[int]:
    return sorted(cache.root.children)


@pytest.mark.parametrize("policy,order", [("lru", [1, 3, 2]), ("lfu", [2, 3, 1])])
def test_eviction_order(policy, order):
    env = Env(policy=policy)
    keys = {1: [1, 1, 1], 2: [2, 2], 3: [3, 3, 3, 3]}
    for key in keys.values():
        env.cache.insert(key, env.alloc.alloc(len(key)))
    # Hits: 1 x3 (earliest), 3 x2, 2 x1 (latest). LRU evicts 1, 3, 2; LFU evicts 2, 3, 1.
    for t, n in ((1, 3), (3, 2), (2, 1)):
        for _ in range(n):
            env.cache.match_prefix(keys[t])
    remaining = [1, 2, 3]
    for victim in order:
        before = env.alloc.available_size()
        node = env.cache.root.children[victim]
        slots = node.value.clone()
        freed = env.cache.evict(1)
        remaining.remove(victim)
        assert _remaining_first_tokens(env.cache) == remaining
        assert freed == slots.numel() and env.alloc.available_size() == before + freed
        assert bool(env.alloc.is_free_mask(slots).all())
        env.cache.check_invariants()


def test_evicting_children_makes_parent_a_candidate():
    env = Env()
    env.cache.insert([1, 2, 3], env.alloc.alloc(3))
    env.cache.insert(
        [1, 2, 4], torch.cat([env.cache.match_prefix([1, 2]).device_indices, env.alloc.alloc(1)])
    )
    assert env.cache.total_size() == 4
    assert env.cache.evict(4) == 4
    assert env.cache.total_size() == 0 and env.alloc.available_size() == env.size
    env.cache.check_invariants()


def test_page_size_alignment():
    env = Env(size=128, page_size=16)
    toks = list(range(100, 140))
    slots = env.alloc.alloc_extend([0], [40], [-1], 40)
    assert env.cache.insert(toks, slots) == 0
    assert env.cache.total_size() == 32  # 40 cut to 2 pages
    env.alloc.free(slots[32:])  # the unaligned tail stays the caller's
    assert len(env.cache.match_prefix(toks[:37]).device_indices) == 32
    m = env.cache.match_prefix(toks[:20] + [7] * 17)  # diverges inside page 2
    assert m.device_indices.tolist() == slots[:16].tolist() and len(m.last_node.key) == 16
    assert len(env.cache.match_prefix(toks[:15]).device_indices) == 0
    env.cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chunked_request_then_finish_returns_pool(page_size):
    env = Env(size=256, page_size=page_size)
    prompt = [random.Random(page_size).randrange(50) for _ in range(50)]
    req = FakeReq(prompt)
    for end in (20, 40, 50):
        assert env.prefill(req, end)
        env.cache.cache_unfinished_req(req)
        aligned = end // page_size * page_size
        assert env.cache.total_size() == aligned
        assert len(req.prefix_indices) == end  # unaligned tail kept as the request's own
        assert req.prefix_indices.tolist() == env.row(req)
        assert env.cache.protected_size() == aligned
        env.check_accounting([req])
    req.output_ids.append(99)  # first sampled token
    for t in range(5):
        assert env.decode(req, 200 + t)
    env.check_accounting([req])
    # A second request with the same prompt shares the cached, page-aligned prefix.
    twin = FakeReq(list(prompt))
    assert env.prefill(twin, 50)
    assert env.row(twin)[: 48 // page_size * page_size] == env.row(req)[: 48 // page_size * page_size]
    env.cache.cache_finished_req(twin)
    env.cache.cache_finished_req(req)
    env.check_accounting([])
    assert env.cache.protected_size() == 0
    assert env.cache.total_size() == 55 // page_size * page_size  # 50 prompt + 5 decoded KVs
    env.cache.evict(env.cache.total_size())
    assert env.alloc.available_size() == env.size and env.pool.available_size() == env.pool.size


def test_concurrent_duplicates_are_freed():
    env = Env()
    r1, r2 = FakeReq([5, 6, 7, 8]), FakeReq([5, 6, 7, 8])
    assert env.prefill(r1, 4) and env.prefill(r2, 4)  # neither sees the other: 8 slots in use
    env.cache.cache_unfinished_req(r1)
    env.cache.cache_unfinished_req(r2)  # r2's copies are freed, its row re-pointed at r1's
    assert env.row(r2) == env.row(r1)
    assert env.alloc.available_size() == env.size - 4
    assert env.cache.root.children[5].lock_ref == 2
    env.check_accounting([r1, r2])
    env.cache.cache_finished_req(r1)
    env.cache.cache_finished_req(r2)
    env.check_accounting([])
    assert env.cache.evict(4) == 4 and env.alloc.available_size() == env.size


def test_unfinished_with_stale_fill_ids_keeps_decoded_tail():
    env = Env(page_size=2)
    req = env.run_prompt([1, 2, 3, 4])
    req.output_ids.append(5)
    assert env.decode(req, 6) and env.decode(req, 7)  # KV for 5 and 6 written; fill_ids still 4 long
    env.cache.cache_unfinished_req(req)
    assert env.cache.total_size() == 4
    assert req.prefix_indices.tolist() == env.row(req) and len(req.prefix_indices) == 6
    env.check_accounting([req])
    env.cache.cache_finished_req(req)  # now [1..6] are cached (6 tokens, page-aligned)
    assert env.cache.total_size() == 6
    env.check_accounting([])
    env.cache.evict(100)
    assert env.alloc.available_size() == env.size


def test_chunk_cache_never_shares():
    env = Env(size=64, page_size=4, chunk=True)
    req = FakeReq(list(range(30)))
    assert env.prefill(req, 10)
    env.cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == env.row(req) and req.last_node is None
    assert env.prefill(req, 30)
    other = FakeReq(list(range(30)))
    assert env.prefill(other, 30) and not set(env.row(other)) & set(env.row(req))
    assert env.cache.match_prefix(list(range(30))).device_indices.numel() == 0
    for r in (req, other):
        env.cache.cache_finished_req(r)
    assert env.alloc.available_size() == env.size and env.pool.available_size() == env.pool.size
    assert env.cache.total_size() == 0 and env.cache.evict(10) == 0


@pytest.mark.parametrize("page_size,policy", [(1, "lru"), (4, "lfu"), (2, "lru")])
def test_randomized_stress(page_size, policy):
    rng = random.Random(1000 + page_size)
    env = Env(size=128, page_size=page_size, policy=policy, max_reqs=6)  # small: forces OOM paths
    bases = [[rng.randrange(4) for _ in range(30)] for _ in range(3)]
    live: list[FakeReq] = []
    pending: dict[int, int] = {}  # id(req) -> prompt tokens still to prefill

    def finish(r: FakeReq) -> None:
        env.cache.cache_finished_req(r)
        live.remove(r)
        pending.pop(id(r), None)

    for _ in range(400):
        op = rng.random()
        if op < 0.3 and env.pool.available_size():
            prompt = rng.choice(bases)[: rng.randrange(1, 30)] + [
                rng.randrange(4) for _ in range(rng.randrange(12))
            ]
            req = FakeReq(prompt)
            end = min(len(prompt), rng.randrange(1, 24))
            if env.prefill(req, end):
                env.cache.cache_unfinished_req(req)
                live.append(req)
                pending[id(req)] = len(prompt) - end
            elif req.req_pool_idx is not None:  # out of memory: undo the admission
                env.cache.dec_lock_ref(req.last_node)
                env.pool.free(req.req_pool_idx)
        elif op < 0.75 and live:
            req = rng.choice(live)
            left = pending.get(id(req), 0)
            if left:
                end = len(req.origin_input_ids) - left + min(left, rng.randrange(1, 16))
                if not env.prefill(req, end):
                    finish(req)  # retract
                    continue
                env.cache.cache_unfinished_req(req)
                pending[id(req)] = len(req.origin_input_ids) - end
                if not pending[id(req)]:
                    req.output_ids.append(rng.randrange(4))
            elif not env.decode(req, rng.randrange(4)):
                finish(req)
        elif op < 0.92 and live:
            finish(rng.choice(live))
        else:
            env.cache.evict(rng.randrange(1, 40))
        env.check_accounting(live)
    for r in list(live):
        finish(r)
    env.check_accounting([])
    env.cache.evict(env.size)
    assert env.cache.total_size() == 0 and env.alloc.available_size() == env.size


def test_pretty_print_and_reset(capsys):
    env = Env()
    env.cache.insert([1, 2, 3], env.alloc.alloc(3))
    text = env.cache.pretty_print()
    assert "len=3" in text and "total=3" in text
    env.cache.reset()
    assert env.cache.total_size() == 0 and env.cache.root.children == {}


def test_row_pointing_at_freed_slots_is_detected():
    env = Env()
    req = FakeReq([1, 2, 3])
    assert env.prefill(req, 3)
    env.alloc.free(env.pool.req_to_token[req.req_pool_idx, :3].long())  # a caller bug
    with pytest.raises(RuntimeError, match="freed KV slots"):
        env.cache.cache_finished_req(req)
    assert env.cache.total_size() == 0


@pytest.mark.parametrize("page_size", [1, 2])
def test_lora_namespaces_never_share_kv(page_size):
    """KV computed under one LoRA adapter (or the base model) is never another's prefix: the
    same tokens cached under "a" are a miss for "b" and for the base, and each namespace keeps
    its own copy."""
    env = Env(size=128, page_size=page_size)
    prompt = [A, B, C, D, F, G, H, A, B]
    env.run_prompt(prompt, finish=True, lora_id="a")
    assert len(env.cache.match_prefix(prompt, "a").device_indices) == len(prompt) // page_size * page_size
    assert len(env.cache.match_prefix(prompt, "b").device_indices) == 0
    assert len(env.cache.match_prefix(prompt).device_indices) == 0
    base = env.run_prompt(prompt, finish=True)
    other = env.run_prompt(prompt, finish=True, lora_id="b")
    assert len(base.prefix_indices) == len(other.prefix_indices) == 0
    slots = {ns: set(env.cache.match_prefix(prompt, ns).device_indices.tolist()) for ns in ("a", "b", None)}
    assert slots["a"].isdisjoint(slots["b"]) and slots["a"].isdisjoint(slots[None])
    again = env.run_prompt(prompt, finish=True, lora_id="b")
    assert len(again.prefix_indices) > 0 and set(again.prefix_indices.tolist()) <= slots["b"]
    env.check_accounting([])
    env.cache.evict(10**6)
    assert env.cache.total_size() == 0
    env.check_accounting([])
