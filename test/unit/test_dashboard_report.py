"""The scheduler's dashboard report (GetDashboardStateReq) on the real-pool fake worker: the batch
log pairs every result with its launch and stays bounded, the request table is bounded and says
each request's state, and the counters only grow."""

from __future__ import annotations

import pytest

from radixserve.managers.io_struct import (
    GetDashboardStateReq,
    GetDashboardStateReqOutput,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.batch_log import BATCH_LOG_SIZE


def _req(rid: str, n: int = 6, max_new: int = 4) -> TokenizedGenerateReqInput:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    sp.normalize()
    return TokenizedGenerateReqInput(rid, "", list(range(10, 10 + n)), sp)


def _report(h, max_rows: int = 50) -> dict:  # noqa: ANN001 - the conftest Harness
    h.step([GetDashboardStateReq(max_rows=max_rows)])
    return h.messages(GetDashboardStateReqOutput)[-1].state


@pytest.mark.parametrize("overlap", [False, True])
def test_batches_are_logged_with_their_tokens_and_bounded(make_harness, overlap: bool) -> None:
    h = make_harness(disable_overlap_schedule=not overlap)
    h.step([_req("a", n=6, max_new=4), _req("b", n=9, max_new=4)])
    h.run_until_idle()
    state = _report(h)
    batches = state["batches"]
    assert batches and batches[-1]["mode"] == "extend"  # newest first: the prefill is the oldest
    assert sum(b["num_prefill_tokens"] for b in batches) == state["num_prefill_tokens"] == 15
    # Each request decodes its 3 tokens after the prefill's first one; the overlap loop runs
    # one step ahead, so it may compute a token for a request that has just finished.
    assert state["num_decode_tokens"] == 6 if not overlap else 6 <= state["num_decode_tokens"] <= 8
    assert state["num_batches"] == len(batches)
    assert all(b["ms"] >= 0 and b["num_reqs"] >= 1 for b in batches)
    assert {b["mode"] for b in batches} <= {"extend", "decode", "mixed"}
    # Every launched batch came back: nothing is left waiting for its result.
    assert not h.scheduler.batch_log._launched
    for i in range(BATCH_LOG_SIZE):  # many more batches than the ring holds
        h.step([_req(f"x{i}", max_new=2)])
    h.run_until_idle()
    state = _report(h)
    assert len(state["batches"]) == BATCH_LOG_SIZE
    assert state["num_batches"] > BATCH_LOG_SIZE


def test_request_table_is_bounded_oldest_first_with_states(make_harness) -> None:
    h = make_harness(max_running_requests=2)
    h.step([_req(f"r{i}", max_new=50) for i in range(5)])
    h.step()
    state = _report(h, max_rows=3)
    rows = state["requests"]
    assert len(rows) == 3 and state["num_live_reqs"] == 5
    assert [r["rid"] for r in rows] == ["r0", "r1", "r2"]
    by_rid = {r["rid"]: r for r in rows}
    assert by_rid["r0"]["state"] == "decoding" and by_rid["r0"]["output_tokens"] >= 1
    assert by_rid["r2"]["state"] == "waiting" and by_rid["r2"]["output_tokens"] == 0
    assert all(r["prompt_tokens"] == 6 and r["age_s"] >= 0 for r in rows)
    assert state["num_running_reqs"] == 2 and state["num_waiting_reqs"] == 3
    assert _report(h, max_rows=10_000)["requests"].__len__() == 5  # capped, and all 5 fit
    assert _report(h, max_rows=-1)["requests"] == []
    h.run_until_idle()
    assert _report(h)["requests"] == []


def test_pool_and_cache_fields(make_harness) -> None:
    h = make_harness()
    h.step([_req("a", n=12, max_new=2)])
    h.run_until_idle()
    h.step([_req("b", n=12, max_new=2)])  # same prompt: a cache hit
    h.run_until_idle()
    state = _report(h)
    assert state["dp_rank"] == 0 and state["max_total_num_tokens"] > 0
    assert (
        state["used_tokens"] + state["available_tokens"] + state["evictable_tokens"]
        == (state["max_total_num_tokens"])
    )
    assert state["cached_tokens"] >= 11 and state["cache_hit_tokens"] >= 11
    assert state["cache_query_tokens"] >= state["cache_hit_tokens"]
    (rank,) = state["ranks"]
    assert rank["tp_rank"] == 0 and rank["pp_rank"] == 0 and rank["mean_batch_ms"] is not None
