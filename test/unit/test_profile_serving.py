"""benchmark/profile_serving.py: how py-spy's raw stacks are sorted into the overhead table."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import profile_serving  # noqa: E402

LOOP = "run_scheduler_process (radixserve/scheduler/scheduler_process.py:106);NormalLoop.step (x.py:1)"


def test_send_inside_result_processing_counts_as_ipc():
    stack = f"{LOOP};OutputProcessor.flush (o.py:170);SchedulerIO.send_output (s.py:50);Socket.send_pyobj (z.py:1)"
    assert profile_serving.classify(stack) == "IPC (zmq send/recv, pickling)"


def test_forward_sampling_batch_and_other():
    assert (
        profile_serving.classify(f"{LOOP};ModelRunner.forward (m.py:149);linear (l.py:1)") == "model forward"
    )
    assert profile_serving.classify(f"{LOOP};ModelRunner.sample (m.py:160)") == "sampling"
    assert (
        profile_serving.classify(f"{LOOP};Scheduler.get_next_batch_to_run (s.py:1)") == "batch construction"
    )
    assert profile_serving.classify(f"{LOOP};Scheduler.process_batch_result (s.py:1)") == "result processing"
    assert profile_serving.classify(LOOP) == "other scheduler Python"


def test_summarize_raw_adds_counts_per_category_and_skips_junk():
    raw = "\n".join(
        [
            f"{LOOP};ModelRunner.forward (m.py:1) 90",
            f"{LOOP};ModelRunner.forward (m.py:2);Sampler (s.py:3) 5",
            f"{LOOP};Socket.send_pyobj (z.py:1) 3",
            f"{LOOP} 2",
            "",
            "not a sample line",
        ]
    )
    counts = profile_serving.summarize_raw(raw)
    assert counts == {"model forward": 95, "IPC (zmq send/recv, pickling)": 3, "other scheduler Python": 2}


def test_cpu_seconds_and_children_of_this_process():
    assert profile_serving.cpu_seconds(os.getpid()) > 0
    assert profile_serving.cpu_seconds(2**22 + 12345) == 0.0  # no such process
    assert isinstance(profile_serving.children(os.getpid()), list)


def test_context_switches_of_this_process() -> None:
    vol, invol = profile_serving.context_switches(os.getpid())
    assert vol > 0 and invol >= 0  # the interpreter has slept on I/O by now
    assert profile_serving.context_switches(2**22 + 12345) == (0, 0)  # no such process


def _batch(t: float, mode: str, reqs: int, ms: float) -> dict[str, float | int | str]:
    return {"launched_at": t, "mode": mode, "num_reqs": reqs, "ms": ms}


def test_step_summary_takes_full_decode_batches_and_consecutive_periods() -> None:
    from peers.step_times import summarize

    steps = [
        _batch(0.00, "extend", 16, 900.0),  # the wave's prefill: not a decode step
        _batch(0.90, "decode", 16, 40.0),
        _batch(0.95, "decode", 16, 44.0),
        _batch(1.00, "decode", 15, 30.0),  # a request left: not a full batch
        _batch(1.04, "decode", 16, 60.0),
        _batch(1.11, "decode", 16, 42.0),
    ]
    s = summarize(steps, 16)
    assert s["count"] == 4
    assert s["median_ms"] == 43.0 and s["max_ms"] == 60.0
    # Periods only between two full decode steps in a row: 50 ms and 70 ms.
    assert abs(s["median_period_ms"] - 60.0) < 1e-6
    assert summarize(steps, 64) == {"count": 0}
