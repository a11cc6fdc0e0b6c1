"""Scheduler knobs asserted directly (issue 22: nothing checked them): the new_token_ratio schedule,
--prefill-max-requests, and when the overlap loop gives up overlap for a batch."""

from __future__ import annotations

import logging

import pytest
from fake_worker import FakeWorker, reference_output

from radixserve.managers.io_struct import FlushCacheReqInput
from radixserve.model_executor.forward_batch import ForwardMode


def ratio(h) -> float:
    return h.scheduler.state.new_token_ratio


@pytest.mark.parametrize("conservativeness, start", [(1.0, 0.4), (2.0, 0.8), (3.0, 1.0), (0.2, 0.08)])
def test_new_token_ratio_starts_decays_and_resets(make_harness, conservativeness, start):
    """Seed 000 §10.3: 0.4 x --schedule-conservativeness (at most 1), minus 0.001 per decode step
    down to 0.1 (or the start, if lower), back to the start when idle and after a flush."""
    h = make_harness(schedule_conservativeness=conservativeness)
    assert ratio(h) == pytest.approx(start)
    h.submit("a", [1, 2, 3], 40)
    h.step()  # prefill: no decay
    assert ratio(h) == pytest.approx(start)
    floor = min(0.1, start)
    for k in range(1, 30):
        h.step()  # one decode step
        assert ratio(h) == pytest.approx(max(start - 0.001 * k, floor)), k
    h.step([FlushCacheReqInput()])  # refused while busy: the ratio stays
    assert ratio(h) == pytest.approx(max(start - 0.03, floor))
    h.run_until_idle()  # the idle self-check resets it
    assert ratio(h) == pytest.approx(start)
    h.submit("b", [4, 5, 6], 5)
    for _ in range(4):
        h.step()
    h.run_until_idle()
    h.scheduler.state.new_token_ratio = 0.25
    h.step([FlushCacheReqInput()])
    assert ratio(h) == pytest.approx(start)


def test_new_token_ratio_after_retraction(make_harness, caplog):
    """A retraction raises the ratio to (tokens decoded + 20 per kept request) / their max_new_tokens
    (at most 1), so admission reserves more for the requests still running."""
    # Optimistic admission (tiny reservations) lets A and B outgrow the 80-token pool together.
    h = make_harness(worker=FakeWorker(max_total_num_tokens=80), schedule_conservativeness=0.01)
    h.submit("A", list(range(1, 11)), 50)
    h.step()
    h.submit("B", list(range(20, 30)), 50)
    with caplog.at_level(logging.WARNING):
        for _ in range(200):
            h.step()
            if "Retract" in caplog.text:
                break
    assert "Retract" in caplog.text
    (kept,) = h.scheduler.state.running_batch.reqs
    # The step that retracted also decoded the kept request once more.
    decoded_at_retraction = len(kept.output_ids) - 1
    assert ratio(h) == pytest.approx(min(1.0, (decoded_at_retraction + 20) / 50))
    h.run_until_idle()
    assert h.outputs["A"] == reference_output(list(range(1, 11)), 50)


@pytest.mark.parametrize("cap, sizes", [(None, [10]), (3, [3, 3, 3, 1]), (1, [1] * 10)])
def test_prefill_max_requests_caps_each_prefill(make_harness, cap, sizes):
    h = make_harness(prefill_max_requests=cap)
    for i in range(10):
        h.submit(f"r{i}", [i + 1, 2, 3], 1)  # max_new_tokens 1: finished by its prefill
    h.run_until_idle()
    assert h.worker.forward_modes == ["EXTEND"] * len(sizes)
    assert h.worker.batch_sizes == sizes


def _batch(h, mode: ForwardMode):
    batch = h.scheduler.make_batch([])
    batch.forward_mode = mode
    return batch


def test_is_disable_overlap_for_batch(make_harness):
    """Two consecutive prefills (a mixed batch counts as one) do not overlap, so the first one's
    tokens come out sooner; everything else does."""
    h = make_harness(disable_overlap_schedule=False)
    s = h.scheduler
    extend, mixed, decode = (
        _batch(h, m) for m in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE)
    )
    cases = [
        (None, extend, False),
        (extend, extend, True),
        (mixed, extend, True),
        (extend, mixed, True),
        (extend, decode, False),
        (decode, extend, False),
        (decode, decode, False),
        (extend, None, False),
    ]
    for last, batch, expected in cases:
        s.state.last_batch = last
        assert s.is_disable_overlap_for_batch(batch) is expected, (last, batch)
    s.state.last_batch = None


def test_consecutive_prefills_process_the_first_before_launching_the_second(make_harness):
    """What the flag does in the loop: A's prefill result is processed before B's prefill starts;
    after a prefill, the next decode is launched first (overlap)."""
    h = make_harness(disable_overlap_schedule=False)
    events: list[str] = []
    launch, process = h.loop.executor.worker.launch, h.scheduler.process_batch_result

    def on_launch(mwb, future_indices):
        events.append(f"launch {mwb.forward_mode.name}")
        return launch(mwb, future_indices)

    def on_process(batch, result):
        events.append(f"process {batch.forward_mode.name}")
        return process(batch, result)

    h.loop.executor.worker.launch, h.scheduler.process_batch_result = on_launch, on_process
    h.submit("A", [1, 2, 3], 3)
    h.step()  # A's prefill
    h.submit("B", [4, 5, 6], 3)
    h.step()  # B's prefill (prefill goes first): A's result is processed before it is launched
    h.step()  # the decode of A and B is launched before B's prefill result is processed
    assert events[:5] == [
        "launch EXTEND",
        "process EXTEND",
        "launch EXTEND",
        "launch DECODE",
        "process EXTEND",
    ]
    h.run_until_idle()


@pytest.mark.parametrize("overlap", [False, True])
def test_heap_is_trimmed_once_per_idle_period_and_on_flush(make_harness, monkeypatch, overlap):
    """Issue 23: freed tensor memory stayed in glibc's arenas and /flush_cache released nothing.
    The scheduler hands it back (malloc_trim) once when it goes idle after work, and on a flush;
    idle steps with nothing run in between do not trim again."""
    import radixserve.scheduler.scheduler as scheduler_module

    trims: list[int] = []
    monkeypatch.setattr(scheduler_module, "release_free_memory", lambda: trims.append(1))
    h = make_harness(disable_overlap_schedule=not overlap)
    h.step()
    h.step()
    assert trims == []  # idle from the start: nothing ran, nothing to trim
    h.submit("a", [1, 2, 3], 4)
    h.run_until_idle()
    assert len(trims) == 1
    for _ in range(3):
        h.step()
    assert len(trims) == 1
    h.step([FlushCacheReqInput()])
    assert len(trims) == 2
    h.submit("b", [4, 5, 6], 4)
    h.run_until_idle()
    assert len(trims) == 3
