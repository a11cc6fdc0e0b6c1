"""--enable-trace in the scheduler: a traced request's queue wait, prefill chunks and decode are
timed per batch and sent once, with its finish; untraced requests, and every request when the flag
is off, cost nothing and send nothing."""

from __future__ import annotations

import pytest

from radixserve.managers.io_struct import BatchTokenIDOut, ReqTrace, TraceContext

TRACE = TraceContext(trace_id="0af7651916cd43dd8448eb211c80319c", span_id="b7ad6b7169203331")


def _traces(h) -> dict[str, list[ReqTrace | None]]:  # noqa: ANN001 - the conftest Harness
    """Every trace each rid was sent with, over all of the scheduler's step messages."""
    out: dict[str, list[ReqTrace | None]] = {}
    for msg in h.messages(BatchTokenIDOut):
        for i, rid in enumerate(msg.rids):
            out.setdefault(rid, []).append(msg.traces[i] if msg.traces is not None else None)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_traced_request_sends_its_chunks_and_decode_once_with_its_finish(make_harness, overlap: bool) -> None:
    h = make_harness(enable_trace=True, chunked_prefill_size=4, disable_overlap_schedule=not overlap)
    h.submit("t", list(range(10, 20)), max_new_tokens=4, stream=True, trace=TRACE)
    h.submit("u", list(range(30, 36)), max_new_tokens=4, stream=True)  # no trace context
    h.run_until_idle()
    sent = _traces(h)
    assert all(t is None for t in sent["u"])
    assert all(t is None for t in sent["t"][:-1])  # only the final message carries it
    trace = sent["t"][-1]
    assert isinstance(trace, ReqTrace)
    # 10 prompt tokens in chunks of at most 4, in order, each ending after it started.
    assert [n for _, _, n in trace.chunks] == [4, 4, 2]
    assert trace.first_scheduled == trace.chunks[0][0]
    assert trace.arrived <= trace.first_scheduled
    for (s0, e0, _), (s1, _, _) in zip(trace.chunks, trace.chunks[1:]):
        assert s0 <= e0 and s0 <= s1
    # The first token comes from the last chunk; the other 3 from decode steps (the overlap loop
    # may launch one more for a request that has just finished).
    assert 3 <= trace.num_decode_steps <= 4
    assert trace.decode_start is not None and trace.decode_end is not None
    assert trace.chunks[-1][0] <= trace.decode_start <= trace.decode_end <= trace.sent
    assert not h.scheduler.batch_log.timer._launched  # every launch paired with its result


def test_off_sends_no_trace_even_for_a_request_with_a_context(make_harness) -> None:
    h = make_harness()
    assert h.scheduler.batch_log.timer is None
    h.submit("t", list(range(10, 16)), max_new_tokens=3, trace=TRACE)
    h.run_until_idle()
    assert h.finished["t"] is not None
    assert all(m.traces is None for m in h.messages(BatchTokenIDOut))


def test_a_request_that_never_decodes_has_no_decode_times(make_harness) -> None:
    h = make_harness(enable_trace=True)
    h.submit("one", list(range(10, 16)), max_new_tokens=1, trace=TRACE)
    h.run_until_idle()
    trace = _traces(h)["one"][-1]
    assert trace is not None and len(trace.chunks) == 1 and trace.chunks[0][2] == 6
    assert trace.decode_start is None and trace.num_decode_steps == 0
