"""The batch-level back-off rule (speculative/batch_gate.py): each request drafts as many tokens as
its acceptance pays for at the measured cost of a verify row, and a step drafts only when its
drafters' expected accepted drafts beat the step's measured extra cost at this batch size."""

from __future__ import annotations

import dataclasses
import math

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
from radixserve.speculative.batch_gate import (
    PROBE_AFTER,
    RowCost,
    StepCosts,
    draft_length,
    expected_accepts,
    step_pays,
)
from radixserve.speculative.decode_step import SpeculativeDecodeStep
from radixserve.speculative.ngram_drafter import MatchAcceptance, NgramConfig, NgramDrafter, SpecReqState
from req_factory import make_req


def _costs(bs: int, decode_s: float, verify: list[tuple[int, float]]) -> StepCosts:
    """Decode steps of `decode_s`, and verify steps of (drafted rows, seconds), three rounds."""
    costs = StepCosts()
    for _ in range(3):
        costs.observe(False, bs, decode_s)
        for rows, seconds in verify:
            costs.observe(True, bs, seconds, bs + rows)
    return costs


def test_row_cost_is_measured_per_batch_size():
    """T_verify = T_decode + O + E t: with drafted rows that vary, O and t are told apart; in tokens
    of plain decoding at bs 4 (400 tokens/s): O 1 ms -> 0.4, t 2 ms -> 0.8 per row."""
    costs = StepCosts()
    assert costs.row_cost(4) is None  # nothing measured: steps draft at full length
    costs = _costs(4, 0.010, [(2, 0.015), (8, 0.027), (4, 0.019)])
    cost = costs.row_cost(4)
    assert cost.overhead == pytest.approx(0.4, abs=1e-6)
    assert cost.per_row == pytest.approx(0.8, abs=1e-6)
    assert costs.row_cost(1) is None
    # The same number of rows every time: the whole extra time is charged to the rows.
    cost = _costs(4, 0.010, [(4, 0.018)]).row_cost(4)
    assert cost.overhead == 0.0 and cost.per_row == pytest.approx(0.8)
    assert step_pays(3.3, 4, cost, probe=False)
    assert not step_pays(3.1, 4, cost, probe=False)
    assert step_pays(0.0, 4, cost, probe=True)
    assert step_pays(0.0, 4, None, probe=False)


def test_draft_length_follows_acceptance():
    """The n-th draft is worth alpha_1 .. alpha_n tokens: drafted while that beats a row's cost."""
    cost = RowCost(overhead=0.0, per_row=0.1)
    assert draft_length([0.9] * 7, cost) == 7  # 0.9^7 = 0.48
    assert draft_length([0.5] * 7, cost) == 3  # 0.125 > 0.1 > 0.0625
    assert draft_length([0.09] * 7, cost) == 0
    assert draft_length([0.09] * 7, None) == 7  # not measured yet: all of them
    assert draft_length([0.3, 0.9, 0.9], cost) == 3  # a weak first draft, sure ones after it
    assert draft_length([0.9, 0.1, 0.99], cost) == 1  # 0.9 pays, 0.09 does not (nor what follows)
    assert expected_accepts([0.5] * 3) == pytest.approx(0.875)
    assert expected_accepts([0.5, 1.0, 0.5]) == pytest.approx(0.5 + 0.5 + 0.25)


def test_request_acceptance_estimate():
    st = SpecReqState(trie=None)
    assert st.alpha == 0.5  # the prior
    for _ in range(10):
        st.on_verified(3, 0)
    assert st.alpha < 0.1
    st.on_gated()
    for _ in range(3):
        st.on_verified(3, 3)  # all accepted: no rejection to count
    assert st.gated_streak == 0 and st.alpha > 0.8
    st.on_verified(4, 1)
    assert 0.5 < st.alpha < 0.8


def _batch(n: int) -> tuple[ScheduleBatch, KVMemory]:
    allocator = TokenToKVPoolAllocator(1024, 1)
    rows = ReqToTokenPool(8, 256, "cpu")
    mem = KVMemory(rows, allocator, ChunkCache(rows, allocator, 1), 1)
    reqs = []
    for i in range(n):
        prompt = [5, 6, 7, 8, 9] * 4  # repeats: the trie always has a continuation
        req = make_req(f"r{i}", prompt, SamplingParams(max_new_tokens=64, temperature=0.0))
        req.req_pool_idx = mem.alloc_rows(1)[0]
        slots = mem.alloc_extend([0], [len(prompt)], [-1], len(prompt))
        mem.req_to_token_pool.req_to_token[req.req_pool_idx, : len(prompt)] = slots.to(torch.int32)
        req.kv_committed_len = len(prompt)
        req.output_ids = [5]
        reqs.append(req)
    return ScheduleBatch(reqs, mem, 32), mem


def _step(mem: KVMemory, per_row: float, overhead: float = 0.0) -> SpeculativeDecodeStep:
    """A step whose verify rows are measured at `per_row` tokens each (bs 4, decode 10 ms)."""
    step = SpeculativeDecodeStep(NgramDrafter(NgramConfig(8, 1, 4, 8, 10_000)), mem, max_drafts=7)
    t = per_row * 0.010 / 4
    o = overhead * 0.010 / 4
    step.costs = _costs(4, 0.010, [(2, 0.010 + o + 2 * t), (6, 0.010 + o + 6 * t)])
    return step


def _set_alpha(req: Req, alpha: float) -> None:
    """The request's own acceptance, and no match-length table: its drafts' chances are alpha each."""
    req.spec.accepted, req.spec.rejected = alpha, 1.0 - alpha
    req.spec.matches = None


@pytest.mark.parametrize(
    ("alpha", "overhead", "drafts"),
    [(0.95, 0.0, 7), (0.5, 0.0, 3), (0.5, 3.0, 0), (0.08, 0.0, 0)],
)
def test_draft_lengths_and_the_step_gate(alpha, overhead, drafts):
    """Rows measured at 0.1 token each. alpha 0.95: all 7 drafts pay. alpha 0.5: 3 each (0.875
    expected per request, 3.5 for the step against 1.2 of rows); with a step overhead of 3 tokens
    on top (4.2) the step is a plain decode. alpha 0.08: no draft pays for its row."""
    batch, mem = _batch(4)
    step = _step(mem, per_row=0.1, overhead=overhead)
    for r in batch.reqs:
        step.drafter.draft(r, 100)  # builds req.spec
        _set_alpha(r, alpha)
    step.prepare(batch, 256)
    verifies = drafts > 0
    assert (batch.forward_mode == ForwardMode.TARGET_VERIFY) == verifies
    if verifies:
        assert [len(d) for d in batch.spec_drafts] == [drafts] * 4
    assert all(r.spec.gated_streak == (0 if verifies else 1) for r in batch.reqs)


def test_gated_requests_probe_after_a_while():
    """A request whose drafts do not pay is held back; after PROBE_AFTER steps it drafts one token
    (a cheap probe of whether its text turned repetitive)."""
    batch, mem = _batch(4)
    step = _step(mem, per_row=0.1)
    for r in batch.reqs:
        step.drafter.draft(r, 100)
        _set_alpha(r, 0.05)
    modes = []
    for _ in range(PROBE_AFTER + 1):
        step.prepare(batch, 256)
        modes.append(batch.forward_mode)
        if batch.forward_mode == ForwardMode.TARGET_VERIFY:
            break
    assert modes[:PROBE_AFTER] == [ForwardMode.DECODE] * PROBE_AFTER
    assert modes[-1] == ForwardMode.TARGET_VERIFY
    assert [len(d) for d in batch.spec_drafts] == [1] * 4


def test_lengths_are_not_limited_before_costs_are_measured():
    batch, mem = _batch(4)
    step = SpeculativeDecodeStep(NgramDrafter(NgramConfig(8, 1, 4, 8, 10_000)), mem, max_drafts=7)
    step.prepare(batch, 256)
    assert [len(d) for d in batch.spec_drafts] == [7] * 4


def _teach(matches: MatchAcceptance, window: int, rounds: int, accepted: int, drafted: int) -> None:
    for _ in range(rounds):
        matches.observe(window, drafted, accepted)


def test_match_acceptance_counts_each_draft_at_its_context_length():
    """Draft j of a chain matched on w tokens is counted at length w + j - 1 (capped), accepted or
    rejected; drafts past the first rejected one tell nothing."""
    m = MatchAcceptance(max_length=6)
    assert m.alpha(3) == 0.5  # the prior
    m.observe(2, 4, 1)  # draft 1 (length 2) accepted, draft 2 (length 3) rejected, 3-4 unknown
    assert m.alpha(2) > 0.5 and m.alpha(3) < 0.5 and m.alpha(4) == m.alpha(5) == 0.5
    _teach(m, 5, 20, 4, 4)  # lengths 5, 6, 7 -> 6, 8 -> 6: accepted
    assert m.alpha(5) > 0.9 and m.alpha(6) > 0.9 and m.alpha(9) == m.alpha(6)


def test_draft_alphas_blend_the_request_and_its_match():
    """The request's alpha, raised to the geometric mean of it and the table's at each draft's
    context length where the table's is better; never lowered by it. No table or no match known:
    the request's alpha alone."""
    m = MatchAcceptance(max_length=12)
    _teach(m, 1, 30, 0, 1)  # one-token matches: rejected
    _teach(m, 8, 30, 4, 4)  # long matches: accepted
    st = SpecReqState(trie=None, matches=m)
    st.accepted, st.rejected = 0.25, 0.75
    st.window = 8
    alphas = st.draft_alphas(3)
    assert alphas == pytest.approx([math.sqrt(0.25 * m.alpha(8 + j)) for j in range(3)])
    assert all(a > 0.45 for a in alphas)
    st.window = 1
    assert st.draft_alphas(1) == [0.25]  # the table's 0.02 does not lower it
    st.accepted, st.rejected = 0.9, 0.1
    assert st.draft_alphas(1) == [0.9]
    st.window = 0
    assert st.draft_alphas(2) == [0.9, 0.9]


def _held_back_request_step(
    matches: MatchAcceptance | None, max_window: int
) -> tuple[ScheduleBatch, SpeculativeDecodeStep]:
    """A batch of 4 requests whose own acceptance is 0.05, prepared by a step whose drafter matches
    up to max_window tokens and knows `matches` (None: the request's record alone)."""
    batch, mem = _batch(4)
    step = _step(mem, per_row=0.1)
    step.drafter.config = dataclasses.replace(step.drafter.config, max_window=max_window)
    for r in batch.reqs:
        step.drafter.draft(r, 100)
        r.spec.accepted, r.spec.rejected = 0.05, 0.95
        r.spec.matches = matches
    step.prepare(batch, 256)  # the prompts repeat [5 6 7 8 9]: matches of up to 4 tokens
    return batch, step


def test_a_long_match_drafts_at_once_where_the_request_alone_would_wait():
    """Answers to copy tasks open with new words (short matches, rejected), then copy. A request
    whose own record is poor (alpha 0.05: held back under the request's record alone, for up to
    PROBE_AFTER steps) drafts as soon as its context matches at length, because such matches are
    accepted across the server: sqrt(0.05 x ~0.98) = 0.22 per draft, so one draft pays (0.22 >
    0.1) and a second does not (0.049); its acceptance then raises its own record. On a one-token
    match it is held back."""
    matches = MatchAcceptance(max_length=12)
    _teach(matches, 1, 40, 0, 3)
    _teach(matches, 4, 40, 7, 7)
    batch, _ = _held_back_request_step(matches, max_window=4)
    assert batch.forward_mode == ForwardMode.TARGET_VERIFY
    assert all(r.spec.window == 4 for r in batch.reqs)
    assert [len(d) for d in batch.spec_drafts] == [1] * 4
    batch, _ = _held_back_request_step(None, max_window=4)
    assert batch.forward_mode == ForwardMode.DECODE
    batch, _ = _held_back_request_step(matches, max_window=1)  # the table does not raise it there
    assert batch.forward_mode == ForwardMode.DECODE
    assert all(r.spec.window == 1 and r.spec.gated_streak == 1 for r in batch.reqs)


def test_a_request_that_cannot_pay_is_held_back_without_a_lookup(monkeypatch):
    """When not even the best chance the server's record could give its first draft pays for a
    row, the request is held back before its trie is searched (the lookups of requests that end
    up not drafting cost a few percent of a step at batch 4)."""
    batch, mem = _batch(4)
    step = _step(mem, per_row=0.1)
    for r in batch.reqs:
        step.drafter.draft(r, 100)
        r.spec.accepted, r.spec.rejected = 0.01, 0.99  # sqrt(0.01 x 0.5) = 0.07 < 0.1

        def no_lookup(*args: object) -> None:
            raise AssertionError("looked up a request that cannot pay")

        monkeypatch.setattr(r.spec.trie, "draft_chain", no_lookup)
    step.prepare(batch, 256)
    assert batch.forward_mode == ForwardMode.DECODE
    assert all(r.spec.gated_streak == 1 for r in batch.reqs)


def test_match_acceptance_best_bounds_every_length():
    """best() bounds the chance at every length, the ones not recorded yet (the prior) included:
    it decides whether a request is looked up at all."""
    m = MatchAcceptance(max_length=6)
    assert m.best() == 0.5
    _teach(m, 1, 20, 0, 1)  # only one-token matches recorded, and rejected
    assert m.alpha(1) < 0.1 and m.best() == 0.5  # lengths 2 .. 6 still have the prior
    _teach(m, 3, 20, 4, 4)
    assert m.best() == max(m.alpha(length) for length in range(1, 7)) > 0.9
