"""The scheduler with --enable-hierarchical-cache over a FakeWorker whose "KV" (the token id
written at each slot) lives in a real MHATokenToKVPool, so the host tier copies it like real K/V:
a prefix loaded back from L2 with wrong or missing bytes changes the outputs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fake_worker import FakeWorker, reference_output

from radixserve.managers.io_struct import AbortReq, FlushCacheReqInput, GetInternalStateReq
from radixserve.mem_cache import MHATokenToKVPool


class TieredFakeWorker(FakeWorker):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        ps, slots = self.pools.token_to_kv_pool_allocator.page_size, self.pools.max_total_num_tokens
        kv_pool = MHATokenToKVPool(slots, ps, torch.int64, 1, 1, 1, "cpu")
        self.pools = replace(self.pools, token_to_kv_pool=kv_pool)
        self.kv = kv_pool.k_buffer[0].view(-1)  # [slots]: FakeWorker writes here
        self.kv.fill_(-1)


def conversations(num_docs: int, doc_len: int, turns: int) -> list[list[tuple[str, list[int], int]]]:
    """Rounds of requests: every document with one more follow-up per round."""
    docs = [[(d * 131 + i * 7) % 997 for i in range(doc_len)] for d in range(num_docs)]
    return [[(f"d{d}t{t}", docs[d] + [t + 1, t + 2, d], 4) for d in range(num_docs)] for t in range(turns)]


def serve(make_harness, rounds, page_size: int, **args):
    h = make_harness(
        worker=TieredFakeWorker(max_total_num_tokens=320, page_size=page_size),
        page_size=page_size,
        max_running_requests=2,
        **args,
    )
    for batch in rounds:
        for rid, ids, max_new in batch:
            h.submit(rid, ids, max_new)
        h.run_until_idle()
    assert h.worker.unwritten_reads == 0
    h.step([GetInternalStateReq()])
    return h, h.sent[-1].internal_state


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [None, 48])
def test_prefixes_beyond_the_pool_come_back_from_l2_with_identical_outputs(make_harness, page_size, chunk):
    rounds = conversations(num_docs=6, doc_len=96, turns=3)  # 6 x 96 prefix tokens, a 320-token pool
    base, base_state = serve(make_harness, rounds, page_size, chunked_prefill_size=chunk)
    tiered, state = serve(
        make_harness, rounds, page_size, chunked_prefill_size=chunk, enable_hierarchical_cache=True
    )
    for batch in rounds:
        for rid, ids, max_new in batch:
            assert tiered.outputs[rid] == base.outputs[rid] == reference_output(ids, max_new), rid
    tiers = state["hicache"]
    assert tiers["host_hit_tokens"] > 0 and tiers["load_back_tokens"] > 0 and tiers["backup_bytes"] > 0
    assert tiers["host_tokens"] == 2 * tiers["device_tokens"]
    assert "hicache" not in base_state
    # Prefixes the pool had evicted were reused instead of recomputed.
    assert state["cache_hit_tokens"] > base_state["cache_hit_tokens"]


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_other_write_policies_give_identical_outputs(make_harness, policy):
    rounds = conversations(num_docs=5, doc_len=80, turns=3)
    h, state = serve(make_harness, rounds, 1, enable_hierarchical_cache=True, hicache_write_policy=policy)
    for batch in rounds:
        for rid, ids, max_new in batch:
            assert h.outputs[rid] == reference_output(ids, max_new), rid
    assert state["hicache"]["load_back_tokens"] > 0


def test_aborts_leave_no_slot_in_either_tier_and_flush_empties_both(make_harness):
    h = make_harness(
        worker=TieredFakeWorker(max_total_num_tokens=320),
        max_running_requests=3,
        chunked_prefill_size=32,
        enable_hierarchical_cache=True,
    )
    rounds = conversations(num_docs=6, doc_len=90, turns=3)
    for t, batch in enumerate(rounds):
        for rid, ids, _ in batch:
            h.submit(rid, ids, 12)
        for _ in range(3 + t):
            h.step()
        h.step([AbortReq(rid=batch[t][0]), AbortReq(rid=batch[t + 2][0])])
        h.run_until_idle()
    cache = h.scheduler.mem.tree_cache
    assert h.scheduler.mem.check_leak() is None  # includes the L2 accounting
    assert cache.tier_stats()["load_back_tokens"] > 0 and cache.tier_stats()["host_used_tokens"] > 0
    h.step([FlushCacheReqInput(), GetInternalStateReq()])
    assert h.sent[-2].success
    tiers = h.sent[-1].internal_state["hicache"]
    assert tiers["host_used_tokens"] == 0 and cache.host_allocator.available_size() == tiers["host_tokens"]
