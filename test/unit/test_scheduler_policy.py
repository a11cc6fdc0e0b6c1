"""PrefillAdder budgets and results, schedule policies, in-batch prefix caching, FutureMap."""

from __future__ import annotations

import torch
from fake_worker import FakeWorker

import req_factory
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.overlap import FutureMap
from radixserve.scheduler.policy import LPM_FALLBACK_QUEUE_LEN, SchedulePolicy
from radixserve.scheduler.prefill_adder import CLIP_MAX_NEW_TOKENS, AddReqResult, PrefillAdder
from radixserve.scheduler.req import Req


def make_mem(size: int = 1000, page_size: int = 1, radix: bool = True) -> KVMemory:
    w = FakeWorker(max_total_num_tokens=size, page_size=page_size)
    cls = RadixCache if radix else ChunkCache
    cache = cls(w.pools.req_to_token_pool, w.pools.token_to_kv_pool_allocator, page_size)
    return KVMemory(w.pools.req_to_token_pool, w.pools.token_to_kv_pool_allocator, cache, page_size)


def make_req(rid: str, n: int, max_new: int = 10, start: int = 0, **kw) -> Req:
    return req_factory.make_req(
        rid, list(range(start, start + n)), SamplingParams(max_new_tokens=max_new), **kw
    )


def ready(req: Req, mem: KVMemory) -> Req:
    req.init_next_round_input(mem.tree_cache)
    return req


# ------------------------------------------------------------------------------------ PrefillAdder
def test_adder_continue_and_budget_accounting():
    mem = make_mem(1000)
    adder = PrefillAdder(mem, [], 0.5, rem_input_tokens=500, rem_chunk_tokens=None)
    assert adder.add_one_req(ready(make_req("a", 100, 50), mem)) == AddReqResult.CONTINUE
    assert adder.rem_input_tokens == 400
    assert adder.rem_total_tokens == 1000 - 150
    assert adder.log_input_tokens == 100


def test_adder_no_token_when_pool_short():
    mem = make_mem(200)
    adder = PrefillAdder(mem, [], 0.5, rem_input_tokens=10_000, rem_chunk_tokens=None)
    assert adder.add_one_req(ready(make_req("a", 150, 100), mem)) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == []


def test_adder_reserves_for_running_requests():
    mem = make_mem(1000)
    running = [make_req(f"r{i}", 10, 1000) for i in range(4)]
    adder = PrefillAdder(mem, running, 0.25, rem_input_tokens=10_000, rem_chunk_tokens=None)
    assert adder.rem_total_tokens == 1000 - 4 * 1000 * 0.25
    running = [make_req("big", 10, 100_000)]
    adder = PrefillAdder(mem, running, 0.1, rem_input_tokens=10_000, rem_chunk_tokens=None)
    assert adder.rem_total_tokens == 1000 - CLIP_MAX_NEW_TOKENS * 0.1


def test_adder_first_request_may_exceed_input_budget():
    mem = make_mem(1000)
    adder = PrefillAdder(mem, [], 0.5, rem_input_tokens=50, rem_chunk_tokens=None)
    assert adder.add_one_req(ready(make_req("a", 80, 1), mem)) == AddReqResult.OTHER
    assert [r.rid for r in adder.can_run_list] == ["a"]
    adder = PrefillAdder(mem, [], 0.5, rem_input_tokens=100, rem_chunk_tokens=None)
    assert adder.add_one_req(ready(make_req("a", 30, 1), mem)) == AddReqResult.CONTINUE
    assert adder.add_one_req(ready(make_req("b", 80, 1, start=100), mem)) == AddReqResult.OTHER
    assert [r.rid for r in adder.can_run_list] == ["a"]


def test_adder_chunks_to_page_multiple():
    mem = make_mem(1000, page_size=4)
    adder = PrefillAdder(mem, [], 0.5, rem_input_tokens=1000, rem_chunk_tokens=30)
    req = ready(make_req("a", 100, 5), mem)
    assert adder.add_one_req(req) == AddReqResult.CONTINUE  # 2 tokens of chunk budget left
    assert adder.new_chunked_req is req
    assert req.extend_input_len == 28 and len(req.fill_ids) == 28
    # Less than a page left: a request needing a chunk cannot start one.
    assert adder.add_one_req(ready(make_req("b", 10, 5, start=300), mem)) == AddReqResult.OTHER
    assert [r.rid for r in adder.can_run_list] == ["a"]
    for r in adder.can_run_list:
        mem.tree_cache.dec_lock_ref(r.last_node)
    # A resumed chunk: the rest fits in a fresh chunk budget, so it is the last chunk.
    req.prefix_indices = torch.arange(28, dtype=torch.int64)
    req.init_next_round_input()
    adder2 = PrefillAdder(mem, [], 0.5, rem_input_tokens=1000, rem_chunk_tokens=100)
    assert adder2.add_chunked_req(req) is None and req.extend_input_len == 72


def test_adder_mixed_with_decode_tokens():
    mem = make_mem(1000)
    # 10 riding decodes: 10 input tokens; their KV (here 3 pages of 16 started) counts separately.
    adder = PrefillAdder(
        mem,
        [],
        0.5,
        rem_input_tokens=100,
        rem_chunk_tokens=64,
        mixed_with_decode_tokens=10,
        mixed_with_decode_kv=48,
    )
    assert adder.rem_input_tokens == 90 and adder.rem_chunk_tokens == 54
    assert adder.cur_rem_tokens == 1000 - 48


def test_adder_lock_node_releases():
    mem = make_mem(1000)
    cache = mem.tree_cache
    slots = mem.allocator.alloc(20)
    cache.insert(list(range(20)), slots)
    req = ready(make_req("a", 30, 5), mem)
    assert len(req.prefix_indices) == 20
    adder = PrefillAdder(mem, [], 0.5, rem_input_tokens=1000, rem_chunk_tokens=None)
    adder.add_one_req(req)
    assert cache.protected_size() == 20  # the admission lock, held until the request is released
    cache.dec_lock_ref(req.last_node)
    assert cache.protected_size() == 0


# ------------------------------------------------------------------------------------ policies
def seeded_tree(mem: KVMemory) -> None:
    slots = mem.allocator.alloc(60)
    mem.tree_cache.insert(list(range(60)), slots)


def test_lpm_orders_by_longest_prefix():
    mem = make_mem()
    seeded_tree(mem)
    policy = SchedulePolicy("lpm", mem.tree_cache, False)
    queue = [make_req("none", 50, start=500), make_req("short", 12, start=0), make_req("long", 70, start=0)]
    queue[1].origin_input_ids = list(range(10)) + [900, 901]
    assert policy.calc_priority(queue) is True
    assert [r.rid for r in queue] == ["long", "short", "none"]


def test_lpm_falls_back_to_fcfs_on_long_queue():
    mem = make_mem()
    policy = SchedulePolicy("lpm", mem.tree_cache, False)
    queue = [make_req(f"r{i}", 5, start=i) for i in range(LPM_FALLBACK_QUEUE_LEN + 1)]
    assert policy.calc_priority(queue) is False
    assert [r.rid for r in queue][:3] == ["r0", "r1", "r2"]


def test_in_batch_prefix_caching_deprioritizes_siblings():
    mem = make_mem()
    policy = SchedulePolicy("lpm", mem.tree_cache, False)
    shared = list(range(200, 250))
    a, b, c = make_req("a", 0), make_req("b", 0), make_req("c", 0)
    a.origin_input_ids, b.origin_input_ids, c.origin_input_ids = shared + [1], shared + [2], [7, 8, 9]
    queue = [a, b, c]
    policy.calc_priority(queue)
    assert policy.deprioritized == {id(b)}
    assert queue[-1] is b


def test_in_batch_prefix_caching_waits_for_the_chunked_request():
    """A sibling of the request being chunked waits while the rest of their shared prefix is being
    computed, even with more than CHECK tokens of it cached already (the chunks that ran)."""
    mem = make_mem()
    shared = list(range(200, 300))
    mem.tree_cache.insert(shared[:64], mem.allocator.alloc(64))  # the chunked one's first chunk
    policy = SchedulePolicy("lpm", mem.tree_cache, False)
    chunked, sibling, other = make_req("chunked", 0), make_req("sibling", 0), make_req("other", 0)
    chunked.origin_input_ids, sibling.origin_input_ids = shared + [1], shared + [2]
    other.origin_input_ids = shared[:70] + [3] * 40  # gains only 6 tokens from the rest: runs
    queue = [sibling, other]
    policy.calc_priority(queue, chunked_req=chunked)
    assert len(sibling.prefix_indices) == 64
    assert policy.deprioritized == {id(sibling)}
    policy.calc_priority(queue)  # no chunked request: nothing to wait for
    assert policy.deprioritized == set()


def test_dfs_weight_groups_shared_prefixes():
    mem = make_mem()
    seeded_tree(mem)
    mem.tree_cache.insert(list(range(100, 130)), mem.allocator.alloc(30))
    policy = SchedulePolicy("dfs-weight", mem.tree_cache, False)
    queue = [make_req("x1", 35, start=100), make_req("y1", 65, start=0), make_req("y2", 62, start=0)]
    queue[2].origin_input_ids = list(range(40)) + [999] * 22  # shares 40 tokens of the 60-node
    policy.calc_priority(queue)
    assert [r.rid for r in queue][0] in ("y1", "y2") and queue[-1].rid == "x1"


def test_fcfs_lof_random():
    mem = make_mem()
    q = [make_req("a", 5, 3), make_req("b", 5, 30), make_req("c", 5, 10)]
    SchedulePolicy("fcfs", mem.tree_cache, False).calc_priority(q)
    assert [r.rid for r in q] == ["a", "b", "c"]
    SchedulePolicy("lof", mem.tree_cache, False).calc_priority(q)
    assert [r.rid for r in q] == ["b", "c", "a"]
    orders = set()
    for seed in range(6):
        qq = list(q)
        SchedulePolicy("random", mem.tree_cache, False, seed=seed).calc_priority(qq)
        orders.add(tuple(r.rid for r in qq))
    assert len(orders) > 1


def test_priority_sorts_first_in_every_policy():
    mem = make_mem()
    for name in ("fcfs", "lof", "lpm", "random"):
        q = [make_req("lo", 5, 3, priority=0), make_req("hi", 5, 1, priority=9, start=50)]
        SchedulePolicy(name, mem.tree_cache, True).calc_priority(q)
        assert q[0].rid == "hi", name


def test_cache_aware_policy_without_radix_cache_is_fcfs():
    mem = make_mem(radix=False)
    q = [make_req("a", 5), make_req("b", 9)]
    assert SchedulePolicy("lpm", mem.tree_cache, False).calc_priority(q) is False


# ------------------------------------------------------------------------------------ FutureMap
def test_future_map_resolves_negative_ids():
    fm = FutureMap(max_req_num=4, chunked_prefill_size=None, context_len=100)
    idx = fm.alloc_future_indices(3)
    assert idx == [1, 2, 3]
    fm.store_to_map(idx, torch.tensor([7, 8, 9]))
    mwb = ModelWorkerBatch(
        ForwardMode.DECODE, torch.tensor([-2, 5, -3]), torch.zeros(3), torch.ones(3), torch.zeros(3), None
    )
    fm.resolve_future(mwb)
    assert mwb.input_ids.tolist() == [8, 5, 9]
    for _ in range(10):  # wraps without exceeding the buffer
        assert max(fm.alloc_future_indices(4)) <= fm.future_buffer_len
