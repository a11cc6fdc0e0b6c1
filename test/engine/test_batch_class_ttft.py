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

from radixserve.managers.io_struct import (
    BATCH_PRIORITY,
    AbortReq,
    BatchTokenIDOut,
    TokenizedGenerateReqInput,
)
from radixserve.model_executor.forward_batch import StepYielded
from radixserve.sampling.sampling_params import SamplingParams
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
    # Decodes apart from chunks (the CPU default rides them in the prefill): the arrival's prefill
    # is then a forward of its own.
    run = make_run(
        disable_overlap_schedule=not overlap,
        enable_priority_scheduling=priority_scheduling,
        enable_mixed_chunk=False,
    )
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
    run = make_run(enable_mixed_chunk=False)  # "c" prefills in a forward of its own
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


class FakeSocket:
    """The scheduler's input as IdleCapacityExecutor sees it: `has_input` polls, `recv` drains.
    What is put in `arriving` arrives at the `arrive_at`-th poll (at layer `arrive_at - 1` of a
    forward, when nothing else polls): in the middle of a step, as a client's request does."""

    def __init__(self, arrive_at: int) -> None:
        self.arriving: list[object] = []
        self.msgs: list[object] = []
        self.polls = 0
        self.arrive_at = arrive_at

    def has_input(self) -> bool:
        self.polls += 1
        if self.polls >= self.arrive_at and self.arriving:
            self.msgs += self.arriving
            self.arriving = []
        return bool(self.msgs)

    def recv(self) -> list[object]:
        msgs, self.msgs = self.msgs, []
        return msgs


def yielding_run(make_run, socket: FakeSocket, **overrides: object) -> SchedulerRun:
    """A normal-loop run whose executor yields to `socket` (build_loop's choice on one CPU rank);
    its steps read their input as the process's loop does (run_forever)."""
    from radixserve.scheduler.build import build_loop
    from radixserve.scheduler.idle_capacity import IdleCapacityExecutor

    run = make_run(disable_overlap_schedule=True, **overrides)
    run.loop = build_loop(run.scheduler, socket.has_input)
    assert isinstance(run.loop.executor, IdleCapacityExecutor)
    next_input = run.loop.executor.inputs(socket.recv)

    def step() -> None:
        run.loop.step(next_input())
        run._absorb()

    run.step = step
    return run


def generate_msg(rid: str, prompt: list[int], max_new: int) -> TokenizedGenerateReqInput:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    sp.normalize()
    return TokenizedGenerateReqInput(rid, "", list(prompt), sp, stream=True)


def reported_rids(run: SchedulerRun, since: int) -> list[list[str]]:
    return [list(m.rids) for m in run.sent[since:] if isinstance(m, BatchTokenIDOut)]


class YieldSpy:
    """Where the stopped steps stopped: inside the fused CPU decode or in the module forward. With
    `fused` False the fused decode is told it cannot stop, so such steps take the module forward."""

    def __init__(self, run: SchedulerRun, fused: bool) -> None:
        self.fused_yields = 0
        runner = run.worker.model_runner.cpu_decode_runner
        if fused and (runner is None or not runner.can_yield):
            pytest.skip("this sgl-kernel build has no fused decode that can stop between layers")
        if runner is None:
            return
        self.runner, self.could_yield, replay = runner, runner.can_yield, runner.replay
        if not fused:
            runner.can_yield = False  # until restore()

        def spy_replay(fb: object) -> object:
            try:
                return replay(fb)
            except StepYielded:
                self.fused_yields += 1
                raise

        runner.replay = spy_replay

    def restore(self) -> None:
        if hasattr(self, "runner"):
            del self.runner.replay  # the class's method again
            self.runner.can_yield = self.could_yield


@pytest.mark.parametrize("path", ["fused", "module"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"enable_priority_scheduling": True}, {"enable_mixed_chunk": True}],
    ids=["plain", "priority", "mixed-chunk"],
)
def test_batch_class_step_yields_to_an_arrival(overrides, path, make_run, reference):
    """A decode step of batch lines stops between layers when an interactive request arrives: the
    request's prefill runs and its first token is sent before the stopped step runs again, whole;
    then it decodes beside the lines, and every token equals HF's (the stopped step's KV writes
    are written again). In the fused CPU decode (one compiled call) and in the module forward."""
    socket = FakeSocket(arrive_at=2)
    run = yielding_run(make_run, socket, **overrides)
    spy = YieldSpy(run, fused=path == "fused")
    try:
        stopped_step_gives_way(run, socket, reference)
    finally:
        spy.restore()
    assert spy.fused_yields == (1 if path == "fused" else 0)


def stopped_step_gives_way(run: SchedulerRun, socket: FakeSocket, reference: dict[str, list[int]]) -> None:
    log = ForwardLog(run)
    for rid, prompt, max_new in BATCH_LINES:
        run.submit(rid, prompt, max_new, priority=BATCH_PRIORITY, stream=True)
    for _ in range(4):
        run.step()
    assert log.launched[-1] == ("decode", ["line0", "line1"])
    socket.arriving.append(generate_msg(*INTERACTIVE))
    socket.polls = 0
    num_sent = len(run.sent)
    lines_before = {rid: len(run.outputs[rid]) for rid, _, _ in BATCH_LINES}
    run.step()
    assert run.loop.executor.num_yields == 1
    # The chat's first token went out first, then the lines' tokens of the step that gave way.
    assert reported_rids(run, num_sent) == [["chat"], ["line0", "line1"]]
    assert len(run.outputs["chat"]) == 1
    assert {rid: len(run.outputs[rid]) for rid, _, _ in BATCH_LINES} == {
        rid: n + 1 for rid, n in lines_before.items()
    }
    running = run.scheduler.state.running_batch
    assert {r.rid for r in running.reqs} == {"line0", "line1", "chat"}  # decode together next
    run.step()
    assert log.launched[-1] == ("decode", ["line0", "line1", "chat"])
    run.run_until_idle()
    assert run.loop.executor.num_yields == 1  # a batch with the chat in it never yields
    assert run.outputs == reference
    run.close()


def test_a_stopped_step_holds_control_messages_for_the_next_step(make_run, reference):
    """While a step stands stopped only the generate requests that arrived first are taken; an
    abort behind them (and anything after it) is processed by the next step, in order."""
    socket = FakeSocket(arrive_at=2)
    run = yielding_run(make_run, socket)
    for rid, prompt, max_new in BATCH_LINES:
        run.submit(rid, prompt, max_new, priority=BATCH_PRIORITY)
    for _ in range(4):
        run.step()
    socket.arriving += [generate_msg(*INTERACTIVE), AbortReq(rid="line1"), generate_msg("late", [5, 6, 7], 3)]
    socket.polls = 0
    run.step()
    assert run.loop.executor.num_yields == 1
    assert "line1" not in run.finished and "late" not in run.scheduler.state.live
    run.step()  # the held abort, then the held request, in that order
    assert "late" in run.scheduler.state.live
    run.run_until_idle()
    assert set(run.finished) == {"line0", "line1", "chat", "late"}
    assert run.finished["line1"]["type"] == "abort"
    assert len(run.outputs["line1"]) < len(reference["line1"])
    for rid in ("line0", "chat"):
        assert run.outputs[rid] == reference[rid]
    assert run.outputs["line1"] == reference["line1"][: len(run.outputs["line1"])]
    run.close()


def test_an_interactive_step_never_yields(make_run, reference):
    """Only an all-batch-class decode step asks the socket: with an interactive request in the
    batch, input waits for the step's end as usual."""
    socket = FakeSocket(arrive_at=1)
    run = yielding_run(make_run, socket)
    run.submit(*INTERACTIVE)
    run.step()
    run.step()
    socket.arriving.append(generate_msg(*BATCH_LINES[0]))
    run.step()
    assert run.loop.executor.num_yields == 0 and socket.polls == 0
    run.run_until_idle()
    assert run.outputs["chat"] == reference["chat"]
    run.close()


def test_build_loop_picks_the_yielding_executor_only_where_it_may(make_run):
    from radixserve.scheduler.build import build_loop
    from radixserve.scheduler.idle_capacity import IdleCapacityExecutor
    from radixserve.scheduler.loops import OverlapScheduleExecutor

    normal = make_run(disable_overlap_schedule=True)
    assert isinstance(build_loop(normal.scheduler, lambda: False).executor, IdleCapacityExecutor)
    assert not isinstance(build_loop(normal.scheduler).executor, IdleCapacityExecutor)  # no socket
    overlap = make_run(disable_overlap_schedule=False)
    assert isinstance(build_loop(overlap.scheduler, lambda: False).executor, OverlapScheduleExecutor)
    for run in (normal, overlap):
        run.close()
