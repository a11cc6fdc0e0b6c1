"""Sampling state that depends on earlier tokens (penalties, min_new_tokens, grammar masks) under
both loops. The overlap loop samples such batches delayed (seed 001 §2.2): their forward overlaps
with processing the previous batch's results, and only the sample waits for them."""

from __future__ import annotations

import pytest
from fake_worker import FakeWorker, random_workload

FAVOURITES = (11, 22, 33, 44, 55, 66)  # FakeWorker(favourites=...): outputs cycle among these


def favourite_worker() -> FakeWorker:
    return FakeWorker(favourites=FAVOURITES, eos_token_id=5, eos_period=5)


def penalty_params(i: int) -> dict:
    """Every kind of sampling state that lives in per-row tensors, and plain rows between them."""
    return [
        {},
        {"frequency_penalty": 0.6},
        {"presence_penalty": 0.9},
        {"repetition_penalty": 1.7},
        {"min_new_tokens": 6},
        {"frequency_penalty": -0.4, "presence_penalty": 0.5, "min_new_tokens": 3},
        {"temperature": 0.8, "seed": 100 + i, "frequency_penalty": 0.3},
    ][i % 7]


@pytest.mark.parametrize(
    "overlap, args",
    [(False, {}), (True, {}), (True, {"chunked_prefill_size": 16, "enable_mixed_chunk": True})],
)
def test_penalties_follow_their_rows(make_harness, overlap, args):
    """Penalty and min_new_tokens state lives in per-row tensors that must follow the batch through
    filter (requests finishing), merge (prefills joining) and mixing. With FakeWorker favourites a
    penalty changes the choice at almost every step, so a request's output in a busy batch equals
    its output alone only if its row's state is its own and up to date. The overlap loop samples
    these batches delayed (after the previous batch's tokens are counted) and must match."""
    workload = random_workload(7, 21)
    alone = {}
    for i, (rid, ids, max_new) in enumerate(workload):
        h = make_harness(worker=favourite_worker(), eos=(5,))
        h.submit(rid, ids, max_new + 8, **penalty_params(i))
        h.run_until_idle()
        alone[rid] = h.outputs[rid]
    worker = favourite_worker()
    h = make_harness(worker=worker, eos=(5,), disable_overlap_schedule=not overlap, **args)
    for i, (rid, ids, max_new) in enumerate(workload):
        h.submit(rid, ids, max_new + 8, **penalty_params(i))
        if i % 5 == 4:  # arrivals spread over steps: prefills merge into a running batch
            h.step()
            h.step()
    h.run_until_idle()
    assert h.outputs == alone
    # The penalties do decide tokens here: without them the same requests generate otherwise.
    plain = make_harness(worker=favourite_worker(), eos=(5,))
    for i, (rid, ids, max_new) in enumerate(workload):
        params = {k: v for k, v in penalty_params(i).items() if k in ("temperature", "seed")}
        plain.submit(rid, ids, max_new + 8, **params)
    plain.run_until_idle()
    changed = [rid for i, (rid, _, _) in enumerate(workload) if i % 7 and plain.outputs[rid] != alone[rid]]
    assert len(changed) >= 10, changed
    assert (worker.num_delayed_samples > 0) == overlap
    if args.get("enable_mixed_chunk"):
        assert "MIXED" in worker.forward_modes


def _record_order(h) -> list[str]:
    """Log, in order, each forward launch, delayed-sample launch and result processing of the
    harness's overlap loop, by the batch's first request."""
    events: list[str] = []
    loop, sched = h.loop, h.scheduler
    launch, launch_sample, process = (
        loop.executor.worker.launch,
        loop.executor.worker.launch_sample,
        sched.process_batch_result,
    )

    def on_launch(mwb, future_indices):
        events.append(f"forward{'(delayed sample)' if mwb.delay_sample_launch else ''}")
        return launch(mwb, future_indices)

    def on_sample(pending):
        events.append("sample")
        return launch_sample(pending)

    def on_process(batch, result):
        events.append("process")
        return process(batch, result)

    loop.executor.worker.launch, loop.executor.worker.launch_sample, sched.process_batch_result = (
        on_launch,
        on_sample,
        on_process,
    )
    return events


@pytest.mark.parametrize("params", [{"frequency_penalty": 0.5}, {"min_new_tokens": 4}, {}])
def test_penalized_batches_keep_their_forward_overlapped(make_harness, params):
    """Before, a batch with penalties (or a grammar) was processed before the next batch was even
    built: no overlap at all. Now the next forward is launched first; only its sample waits for
    the processed results. Batches without such state keep the plain overlapped launch."""
    # The worker never emits EOS (every request decodes 11 times); eos=(5,) gives min_new_tokens
    # something to suppress, i.e. per-row state.
    h = make_harness(worker=FakeWorker(favourites=FAVOURITES), eos=(5,), disable_overlap_schedule=False)
    events = _record_order(h)
    h.submit("a", [1, 2, 3], 12, **params)
    h.submit("b", [4, 5, 6, 7], 12, **params)
    per_step = []
    for _ in range(6):  # the prefill, then decodes
        seen = len(events)
        h.step()
        per_step.append(events[seen:])
    if params:
        # Launch N+1's forward, process N (overlapped with it), then sample N+1.
        assert per_step[0] == ["forward(delayed sample)", "sample"]
        assert per_step[1:] == [["forward(delayed sample)", "process", "sample"]] * 5
    else:
        assert per_step == [["forward"]] + [["forward", "process"]] * 5
    h.run_until_idle()
