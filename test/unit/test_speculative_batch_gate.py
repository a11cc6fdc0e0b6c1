"""The batch-level back-off rule (speculative/batch_gate.py): a step drafts only when its drafters'
expected accepted drafts beat the verify step's measured extra cost at this batch size."""

from __future__ import annotations

import pytest
import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.model_executor.forward_batch import ForwardMode
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.req import Req
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.speculative.batch_gate import PROBE_AFTER, StepCosts, step_pays
from radixserve.speculative.decode_step import SpeculativeDecodeStep
from radixserve.speculative.ngram_drafter import NgramConfig, NgramDrafter, SpecReqState


def _costs(bs: int, decode_s: float, verify_s: float) -> StepCosts:
    costs = StepCosts()
    for _ in range(3):
        costs.observe(False, bs, decode_s)
        costs.observe(True, bs, verify_s)
    return costs


def test_extra_cost_is_measured_per_batch_size():
    costs = StepCosts()
    assert costs.extra_cost(4) is None  # nothing measured: steps draft
    costs = _costs(4, 0.010, 0.015)
    assert costs.extra_cost(4) == pytest.approx(4 * 0.5)
    assert costs.extra_cost(1) is None
    assert step_pays(2.5, 4, costs, probe=False)
    assert not step_pays(1.5, 4, costs, probe=False)
    assert step_pays(0.0, 4, costs, probe=True)


def test_request_acceptance_average():
    st = SpecReqState(trie=None)
    assert st.expected_accepts(7) == 7.0  # optimistic before any round
    for _ in range(10):
        st.on_verified(7, 0)
    assert st.expected_accepts(7) < 0.2
    st.on_gated()
    st.on_verified(7, 7)
    assert st.gated_streak == 0 and st.expected_accepts(7) > 2


def _batch(n: int) -> tuple[ScheduleBatch, KVMemory]:
    allocator = TokenToKVPoolAllocator(1024, 1)
    rows = ReqToTokenPool(8, 256, "cpu")
    mem = KVMemory(rows, allocator, ChunkCache(rows, allocator, 1), 1)
    reqs = []
    for i in range(n):
        prompt = [5, 6, 7, 8, 9] * 4  # repeats: the trie always has a continuation
        req = Req(f"r{i}", prompt, SamplingParams(max_new_tokens=64, temperature=0.0))
        req.req_pool_idx = mem.alloc_rows(1)[0]
        slots = mem.alloc_extend([0], [len(prompt)], [-1], len(prompt))
        mem.req_to_token_pool.req_to_token[req.req_pool_idx, : len(prompt)] = slots.to(torch.int32)
        req.kv_committed_len = len(prompt)
        req.output_ids = [5]
        reqs.append(req)
    return ScheduleBatch(reqs, mem, 32), mem


@pytest.mark.parametrize(("accept_ema", "verifies"), [(0.3, False), (3.0, True)])
def test_a_step_that_does_not_pay_is_a_plain_decode(accept_ema, verifies):
    """Four requests whose drafts each expect `accept_ema` accepted tokens, with a verify step
    measured at 1.5x a decode step (extra cost 2 tokens): 1.2 does not pay, 12 does."""
    batch, mem = _batch(4)
    step = SpeculativeDecodeStep(NgramDrafter(NgramConfig(8, 1, 4, 8, 10_000)), mem)
    step.costs = _costs(4, 0.010, 0.015)
    for r in batch.reqs:
        step.drafter.draft(r, 100)  # builds req.spec
        r.spec.accept_ema = accept_ema
    step.prepare(batch, 256)
    assert (batch.forward_mode == ForwardMode.TARGET_VERIFY) == verifies
    assert all(r.spec.gated_streak == (0 if verifies else 1) for r in batch.reqs)


def test_gated_requests_probe_after_a_while():
    batch, mem = _batch(4)
    step = SpeculativeDecodeStep(NgramDrafter(NgramConfig(8, 1, 4, 8, 10_000)), mem)
    step.costs = _costs(4, 0.010, 0.015)
    for r in batch.reqs:
        step.drafter.draft(r, 100)
        r.spec.accept_ema = 0.1
    modes = []
    for _ in range(PROBE_AFTER + 1):
        step.prepare(batch, 256)
        modes.append(batch.forward_mode)
        if batch.forward_mode == ForwardMode.TARGET_VERIFY:
            break
    assert modes[:PROBE_AFTER] == [ForwardMode.DECODE] * PROBE_AFTER
    assert modes[-1] == ForwardMode.TARGET_VERIFY
