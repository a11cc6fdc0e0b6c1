"""Abort in every state, timeouts, queue-full rejection, priority order and preemption."""

from __future__ import annotations

import time

import pytest
from fake_worker import FakeWorker, reference_output

from radixserve.managers.io_struct import AbortReq


def pool_is_full(h) -> bool:
    mem = h.scheduler.mem
    return mem.available_size() + mem.evictable_size() == mem.total_tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_waiting(make_harness, overlap):
    h = make_harness(max_running_requests=1, disable_overlap_schedule=not overlap)
    h.submit("run", list(range(10)), 30)
    h.submit("wait", list(range(20, 30)), 30)
    h.step()
    assert [r.rid for r in h.scheduler.state.waiting_queue] == ["wait"]
    h.step([AbortReq(rid="wait")])
    assert h.finished["wait"] == {"type": "abort", "message": "Aborted by AbortReq.", "status_code": None}
    assert h.outputs["wait"] == []
    h.run_until_idle()
    assert h.outputs["run"] == reference_output(list(range(10)), 30)
    assert pool_is_full(h)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_chunked(make_harness, overlap):
    h = make_harness(chunked_prefill_size=8, disable_overlap_schedule=not overlap)
    h.submit("long", list(range(40)), 10)
    h.step()
    h.step()
    assert h.scheduler.state.chunked_req is not None
    h.step([AbortReq(rid="long")])
    h.run_until_idle()
    assert h.finished["long"]["type"] == "abort"
    assert h.scheduler.state.chunked_req is None
    assert pool_is_full(h)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_running_by_prefix_and_all(make_harness, overlap):
    h = make_harness(disable_overlap_schedule=not overlap)
    for rid in ("abc-0", "abc-1", "other"):
        h.submit(rid, list(range(5, 25)), 50, stream=True)
    for _ in range(4):
        h.step()
    h.step([AbortReq(rid="abc")])
    h.step()
    h.step()
    assert h.finished["abc-0"]["type"] == "abort" and h.finished["abc-1"]["type"] == "abort"
    assert "other" not in h.finished
    h.step([AbortReq(abort_all=True)])
    h.run_until_idle()
    assert h.finished["other"]["type"] == "abort"
    assert pool_is_full(h)


def test_queue_full_rejected(make_harness):
    """Only what the running batch cannot take counts: q0 runs, q1-q2 wait (the cap), q3 is refused;
    a later arrival beyond the cap is refused too, never a request accepted earlier."""
    h = make_harness(max_queued_requests=2, max_running_requests=1)
    for i in range(4):
        h.submit(f"q{i}", [1, 2, 3, i], 3)
    h.step()
    assert h.finished == {
        "q3": {"type": "abort", "message": "The request queue is full.", "status_code": 503}
    }
    h.submit("q4", [1, 2, 3, 4], 3)
    h.step()
    assert h.finished["q4"]["status_code"] == 503 and "q1" not in h.finished and "q2" not in h.finished
    h.run_until_idle()
    assert all(h.finished[f"q{i}"]["type"] == "length" for i in range(3))


@pytest.mark.parametrize("overlap", [False, True])
def test_burst_to_an_idle_server_is_not_refused(make_harness, overlap):
    """Issue 23: with --max-queued-requests 8 a burst of 100 to an idle server refused 91 although
    the running batch could take them all at once: what the step admits does not count."""
    h = make_harness(max_queued_requests=8, disable_overlap_schedule=not overlap)
    for i in range(40):
        h.submit(f"b{i}", [7, i % 50 + 1, 3], 4)
    h.step()
    assert not h.finished, h.finished
    assert len(h.scheduler.state.waiting_queue) == 0
    h.run_until_idle()
    assert all(h.finished[f"b{i}"]["type"] == "length" for i in range(40))
    # With the running batch full, the same burst leaves exactly the cap waiting.
    h = make_harness(max_queued_requests=8, max_running_requests=16, disable_overlap_schedule=not overlap)
    for i in range(40):
        h.submit(f"c{i}", [7, i % 50 + 1, 3], 4)
    h.step()
    refused = sorted(int(r[1:]) for r, f in h.finished.items() if f["status_code"] == 503)
    assert refused == list(range(24, 40)) and len(h.scheduler.state.waiting_queue) == 8
    h.run_until_idle()


class _NeverCompiles:
    """A grammar backend whose compilations never finish: requests stay in the grammar queue."""

    def __init__(self) -> None:
        from concurrent.futures import Future

        self.future: Future = Future()

    def get_cached_or_future_value(self, key):
        return self.future, False

    def shutdown(self) -> None:
        return None


def test_grammar_queue_counts_against_the_cap(make_harness):
    """Issue 22: constrained requests waiting for their grammar bypassed the cap entirely."""
    h = make_harness(max_queued_requests=3)
    h.scheduler.grammar._backend_factory = _NeverCompiles
    schema = '{"type": "object"}'
    for i in range(6):
        h.submit(f"j{i}", [1, 2, i], 4, json_schema=schema)
    h.submit("plain", [4, 5, 6], 4)  # admitted this step: does not count
    h.step()
    h.step()  # refused constrained requests are finished by the grammar queue's next check
    refused = sorted(r for r, f in h.finished.items() if f["status_code"] == 503)
    assert refused == ["j3", "j4", "j5"] and len(h.scheduler.grammar.grammar_queue) == 3
    h.submit("j6", [1, 2, 6], 4, json_schema=schema)
    h.step()
    h.step()
    assert h.finished["j6"]["status_code"] == 503
    h.step([AbortReq(abort_all=True)])
    h.run_until_idle()
    assert h.finished["plain"]["type"] == "length"


def test_waiting_timeout(make_harness):
    h = make_harness(max_running_requests=1, waiting_timeout=0.05)
    h.submit("first", list(range(10)), 5)
    h.step()
    h.submit("late", list(range(10, 20)), 5)
    time.sleep(0.06)
    h.run_until_idle()
    assert h.finished["late"]["type"] == "abort" and "waiting timeout" in h.finished["late"]["message"]
    assert h.finished["first"]["type"] == "length"


@pytest.mark.parametrize("overlap", [False, True])
def test_running_timeout(make_harness, overlap):
    h = make_harness(running_timeout=0.0, disable_overlap_schedule=not overlap)
    h.submit("slow", list(range(10)), 500)
    h.run_until_idle()
    assert h.finished["slow"]["type"] == "abort" and "running timeout" in h.finished["slow"]["message"]
    assert len(h.outputs["slow"]) < 10
    assert pool_is_full(h)


def test_priority_order(make_harness):
    h = make_harness(max_running_requests=1, enable_priority_scheduling=True, schedule_policy="fcfs")
    h.submit("busy", list(range(10)), 3, priority=100)
    h.step()
    for rid, prio in (("low", 0), ("high", 5), ("mid", 2), ("high2", 5)):
        h.submit(rid, list(range(30, 40)), 2, priority=prio)
    h.run_until_idle()
    order = [rid for rid in h.finished if rid != "busy"]
    assert order == ["high", "high2", "mid", "low"]


@pytest.mark.parametrize("overlap", [False, True])
def test_priority_preemption(make_harness, overlap):
    h = make_harness(
        max_running_requests=2,
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=3,
        disable_overlap_schedule=not overlap,
    )
    h.submit("low", list(range(10)), 40, priority=0)
    h.submit("near", list(range(50, 60)), 40, priority=9)
    for _ in range(3):
        h.step()
    h.submit("urgent", list(range(100, 110)), 5, priority=10)
    h.step()
    h.step()
    st = h.scheduler.state
    # low (gap 10 > 3) is preempted; near (gap 1) keeps running.
    assert any(r.rid == "low" for r in st.waiting_queue)
    h.run_until_idle()
    assert list(h.finished)[0] == "urgent"
    for rid, ids in (("low", list(range(10))), ("near", list(range(50, 60)))):
        assert h.outputs[rid] == reference_output(ids, 40)


def test_preemption_respects_threshold(make_harness):
    h = make_harness(
        max_running_requests=1, enable_priority_scheduling=True, priority_scheduling_preemption_threshold=10
    )
    h.submit("low", list(range(10)), 20, priority=0)
    h.step()
    h.submit("slightly", list(range(20, 30)), 3, priority=5)
    h.run_until_idle()
    assert list(h.finished) == ["low", "slightly"]


def test_retraction_victim_is_lowest_priority(make_harness):
    worker = FakeWorker(max_total_num_tokens=160)
    h = make_harness(
        worker=worker, enable_priority_scheduling=True, priority_scheduling_preemption_threshold=1000
    )
    h.submit("vip", list(range(10)), 60, priority=10)
    h.submit("pleb", list(range(20, 30)), 60, priority=0)
    h.run_until_idle()
    assert h.outputs["vip"] == reference_output(list(range(10)), 60)
    assert h.outputs["pleb"] == reference_output(list(range(20, 30)), 60)
    assert list(h.finished)[0] == "vip"


@pytest.mark.parametrize("overlap", [False, True])
def test_max_new_tokens_zero_prefills_only(make_harness, overlap):
    h = make_harness(disable_overlap_schedule=not overlap)
    h.submit("prompt-only", list(range(1, 30)), max_new_tokens=0, return_logprob=True, logprob_start_len=0)
    h.submit("normal", list(range(1, 30)), max_new_tokens=3)
    h.run_until_idle()
    assert h.outputs.get("prompt-only", []) == []
    assert h.finished["prompt-only"]["type"] == "length"
    assert len(h.input_logprobs["prompt-only"]) == 28  # positions 1 .. 28
    assert len(h.outputs["normal"]) == 3


@pytest.mark.parametrize("overlap", [False, True])
def test_health_probe_on_a_busy_scheduler_is_answered_by_the_next_batch(make_harness, overlap):
    """The seeds' return_health_check_ct: a /health_generate probe never waits behind work, nor
    is it refused by a full queue (a load balancer would take the busy server for a dead one)."""
    h = make_harness(max_queued_requests=1, max_running_requests=1, disable_overlap_schedule=not overlap)
    for i in range(2):
        h.submit(f"w{i}", [1, 2, 3, i], 20)
    h.step()
    assert [r.rid for r in h.scheduler.state.waiting_queue] == ["w1"]  # the queue is at its cap
    h.submit("probe", [0], 1, health_check=True)
    assert all(r.rid != "probe" for r in h.scheduler.state.waiting_queue)
    for _ in range(3):  # the overlap loop answers it when the in-flight batch's result is back
        h.step()
    assert h.finished["probe"] == {"type": "length", "length": 0}
    assert h.outputs.get("probe", []) == [] and "w0" not in h.finished
    h.run_until_idle()
    assert h.finished["w0"]["type"] == h.finished["w1"]["type"] == "length"
    assert pool_is_full(h)


def test_health_probe_on_an_idle_scheduler_runs_the_model(make_harness):
    h = make_harness()
    h.submit("probe", [0], 1, health_check=True)
    h.run_until_idle()
    assert h.finished["probe"] == {"type": "length", "length": 1} and len(h.outputs["probe"]) == 1
