"""Issue 42: batch-class requests (OpenAI batch lines, BATCH_PRIORITY) must not delay an interactive
request's prefill. Deterministic, no timing: while batch lines decode, nothing is left in flight
when the scheduler receives an interactive request (the overlap loop would otherwise have launched
one more batch-class step ahead of it), its prefill is the very next forward, and every request's
greedy tokens equal HF's."""

from __future__ import annotations

import random

import pytest
import torch
from scheduler_harness import SchedulerRun, WorkerCache, until_eos

from radixserve.managers.io_struct import BATCH_PRIORITY
from radixserve.scheduler.loops import only_batch_class
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy

RNG = random.Random(42)
BATCH_LINES = [(f"line{i}", [RNG.randrange(3, TINY_VOCAB) for _ in range(12)], 24) for i in range(2)]
INTERACTIVE = ("chat", [RNG.randrange(3, TINY_VOCAB) for _ in range(9)], 8)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    return {rid: until_eos(hf_greedy(model, p, n)[0]) for rid, p, n in [*BATCH_LINES, INTERACTIVE]}


@pytest.fixture
def make_run(tiny_model_dir):
    workers, runs = WorkerCache(tiny_model_dir), []

    def factory(**overrides: object) -> SchedulerRun:
        worker, args = workers.get("llama", 16)
        runs.append(SchedulerRun(worker, args, **overrides))
        return runs[-1]

    yield factory
    for run in runs:
        if not run.closed:
            run.force_clean()


class ForwardLog:
    """What the loop launched (mode, rids) and how many results it processed, in order."""

    def __init__(self, run: SchedulerRun) -> None:
        self.launched: list[tuple[str, list[str]]] = []
        self.num_processed = 0
        executor, loop = run.loop.executor, run.loop
        launch, finish = executor.launch, loop.finish

        def spy_launch(batch: ScheduleBatch, fin: object) -> None:
            mode = "prefill" if batch.forward_mode.is_prefill() else "decode"
            self.launched.append((mode, [r.rid for r in batch.reqs]))
            launch(batch, fin)

        def spy_finish(batch: ScheduleBatch, result: object) -> None:
            self.num_processed += 1
            finish(batch, result)

        executor.launch = spy_launch  # instance attributes: the loop calls them through self
        loop.finish = spy_finish

    def in_flight(self) -> int:
        return len(self.launched) - self.num_processed


@pytest.mark.parametrize("priority_scheduling", [False, True], ids=["prio-off", "prio-on"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_interactive_prefill_is_next_forward(overlap, priority_scheduling, make_run, reference):
    run = make_run(disable_overlap_schedule=not overlap, enable_priority_scheduling=priority_scheduling)
    log = ForwardLog(run)
    for rid, prompt, max_new in BATCH_LINES:
        run.submit(rid, prompt, max_new, priority=BATCH_PRIORITY)
    for _ in range(4):  # the lines' prefill, then decode steps
        run.step()
    assert log.launched[-1] == ("decode", ["line0", "line1"])
    # Nothing batch-class is in flight when the interactive request arrives: its wait is at most
    # the rest of the step that was running, never one more batch-class step launched ahead.
    assert log.in_flight() == 0
    num_before = len(log.launched)
    rid, prompt, max_new = INTERACTIVE
    run.submit(rid, prompt, max_new)
    run.step()
    assert log.launched[num_before] == ("prefill", ["chat"])
    run.run_until_idle()
    assert set(run.finished) == {"line0", "line1", "chat"}  # the batch lines were not starved
    assert run.outputs == reference
    run.close()


def test_batch_class_lines_keep_overlap_beside_interactive(make_run, reference):
    """Only an all-batch-class batch gives up the overlap: with an interactive request decoding in
    it, the next batch is launched before its results are processed, as usual."""
    run = make_run(disable_overlap_schedule=False)
    log = ForwardLog(run)
    for rid, prompt, max_new in BATCH_LINES:
        run.submit(rid, prompt, max_new, priority=BATCH_PRIORITY)
    run.submit(*INTERACTIVE)
    max_in_flight = 0
    while not run.scheduler.is_idle():
        run.step()
        max_in_flight = max(max_in_flight, log.in_flight())
    run.step()
    assert max_in_flight == 1
    assert run.outputs == reference
    run.close()


def test_only_batch_class(make_run):
    run = make_run()
    run.submit("a", [5, 6, 7], 2, priority=BATCH_PRIORITY)
    run.submit("b", [5, 6, 8], 2, priority=BATCH_PRIORITY - 1)
    run.step()
    batch = run.scheduler.state.last_batch
    assert batch is not None and only_batch_class(batch)
    run.submit("c", [5, 6, 9], 2, priority=BATCH_PRIORITY + 1)
    run.step()  # "c" prefills alone (prefill first): then it decodes beside "a" and "b"
    run.step()
    batch = run.scheduler.state.last_batch
    assert batch is not None and {r.rid for r in batch.reqs} == {"a", "b", "c"}
    assert not only_batch_class(batch)
    run.run_until_idle()
    run.close()
