"""The control plane's ordering and state machine on the real-pool fake worker (no model): a
weight update waits for the requests in flight and holds the ones behind it, queries pass it,
pause holds new requests and retract / in_place keep the running ones; the watchdog fires only
on a busy scheduler that stopped stepping; session_params parsing."""

from __future__ import annotations

import threading
import time

import pytest

from radixserve.managers.generate_request import parse_session_params
from radixserve.managers.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    PauseGenerationReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
)
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.watchdog import SchedulerWatchdog


def _req(rid: str, n: int = 5, max_new: int = 6) -> TokenizedGenerateReqInput:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    sp.normalize()
    return TokenizedGenerateReqInput(rid, "", list(range(10, 10 + n)), sp)


def _finished(h, rid: str) -> bool:  # noqa: ANN001 - the conftest Harness
    return rid in h.finished


def test_weight_update_waits_for_in_flight_requests_and_holds_later_ones(make_harness) -> None:
    h = make_harness()
    h.step([_req("early", max_new=20)])
    h.step([UpdateWeightFromDiskReqInput("/ckpt"), _req("late"), GetInternalStateReq()])
    # The query passed the waiting update; the late request is held (not even queued).
    assert h.messages(GetInternalStateReqOutput)
    assert not h.messages(UpdateWeightFromDiskReqOutput)
    assert "late" not in h.scheduler.state.live
    assert not h.scheduler.is_idle()
    order: list[str] = []
    while not h.messages(UpdateWeightFromDiskReqOutput):
        h.step()
        if _finished(h, "early") and "early" not in order:
            order.append("early")
    order.append("update")
    # The fake worker cannot load weights: the reply says so (and nothing else happened to it).
    reply = h.messages(UpdateWeightFromDiskReqOutput)[0]
    assert reply.success is False and "cannot update weights" in reply.message
    assert order == ["early", "update"] and "late" not in h.finished
    h.run_until_idle()
    assert h.finished["late"]["type"] == "length"


def test_abort_all_requests_aborts_instead_of_waiting(make_harness) -> None:
    h = make_harness()
    h.step([_req("victim", max_new=500)])
    h.step([UpdateWeightFromDiskReqInput("/ckpt", abort_all_requests=True)])
    h.run_until_idle()
    assert h.finished["victim"]["type"] == "abort"
    assert len(h.outputs["victim"]) < 500
    assert h.messages(UpdateWeightFromDiskReqOutput)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_holds_new_requests_and_keeps_the_running_ones(make_harness, mode: str) -> None:
    reference = make_harness()
    reference.step([_req("r", max_new=30)])
    reference.run_until_idle()

    h = make_harness()
    h.step([_req("r", max_new=30)])
    h.step()
    h.step([PauseGenerationReqInput(mode), _req("new")])
    progress = len(h.outputs.get("r", []))
    for _ in range(5):
        h.step()
    assert len(h.outputs.get("r", [])) == progress  # nothing runs while paused
    assert "new" not in h.scheduler.state.live
    st = h.scheduler.state
    if mode == "retract":
        assert [r.rid for r in st.waiting_queue] == ["r"] and st.running_batch.is_empty()
    else:
        assert [r.rid for r in st.running_batch.reqs] == ["r"]
    assert h.scheduler.should_block_on_recv()  # paused with nothing in flight: no busy loop
    h.step([ContinueGenerationReqInput()])
    h.run_until_idle()
    assert h.outputs["r"] == reference.outputs["r"]
    assert h.finished["new"]["type"] == "length"


def test_an_abort_finishes_a_request_held_by_a_pause(make_harness) -> None:
    h = make_harness()
    h.step([PauseGenerationReqInput("in_place"), _req("held"), _req("other")])
    h.step([AbortReq(rid="held")])
    h.step()
    assert h.finished["held"]["type"] == "abort" and "other" not in h.finished
    h.step([ContinueGenerationReqInput()])
    h.run_until_idle()
    assert h.finished["other"]["type"] == "length"


def test_abort_pause_aborts_running_requests(make_harness) -> None:
    h = make_harness()
    h.step([_req("r", max_new=300)])
    h.step([PauseGenerationReqInput("abort"), _req("held")])
    for _ in range(3):
        h.step()
    assert h.finished["r"]["type"] == "abort" and "held" not in h.finished
    h.step([ContinueGenerationReqInput()])
    h.run_until_idle()
    assert h.finished["held"]["type"] == "length"


def test_watchdog_fires_only_when_busy_and_stuck() -> None:
    fired = threading.Event()
    state = {"steps": 0, "busy": False}
    dog = SchedulerWatchdog(0.2, lambda: state["steps"], lambda: state["busy"], fired.set).start()
    try:
        time.sleep(0.5)
        assert not fired.is_set()  # idle: never fired
        state["busy"] = True
        for _ in range(10):  # busy but stepping
            state["steps"] += 1
            time.sleep(0.05)
        assert not fired.is_set()
        assert fired.wait(2)  # busy and no step for longer than the timeout
    finally:
        dog.stop()


def test_parse_session_params() -> None:
    assert parse_session_params(None) is None
    assert parse_session_params({"id": "s", "rid": "r", "offset": 3, "replace": True}) == SessionParams(
        "s", "r", 3, True, None
    )
    for bad, match in (
        ({"id": "s", "turn": 1}, "Unknown session_params"),
        ({"id": 5}, "session_params.id must be a str"),
        ({"id": "s", "offset": True}, "offset must be a int"),
        ({"id": "s", "offset": -2}, "offset must be >= 0"),
        ([1], "must be an object"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_session_params(bad)  # type: ignore[arg-type]
