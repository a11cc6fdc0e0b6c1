"""Overlap machinery: the FutureMap (the same code runs on CPU and on the device), executor choice,
and the CUDA executor's contract — tokens readable only after copy_done — driven on CPU."""

from __future__ import annotations

import pytest
import torch
from fake_worker import FakeWorker, random_workload, reference_output
from test_scheduler_core import run_workload

from radixserve.managers.control_messages import SetInternalStateReq
from radixserve.model_executor.forward_batch import ForwardMode, GenerationBatchResult, ModelWorkerBatch
from radixserve.model_executor.overlap_cuda import LaunchedBatch
from radixserve.scheduler import loops as scheduler_module  # the event loops build the executor
from radixserve.scheduler.overlap import FutureMap, create_overlap_executor
from radixserve.scheduler.overlap_thread import ThreadOverlapExecutor

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _mwb(input_ids: list[int]) -> ModelWorkerBatch:
    n = len(input_ids)
    ids = torch.tensor(input_ids, dtype=torch.int64)
    return ModelWorkerBatch(ForwardMode.DECODE, ids, torch.zeros(n, dtype=torch.int64), ids.abs(), ids, None)


def test_future_map_sizing_and_contiguous_wrap():
    fm = FutureMap(max_req_num=4, chunked_prefill_size=8, context_len=20)
    assert fm.future_limit == 4 * (3 + 3) and fm.future_buffer_len == fm.future_limit + 8
    seen = []
    for bs in [3, 4, 1, 4, 4, 2, 4, 4, 4, 4, 3, 4]:
        idx = fm.alloc_future_indices(bs)
        assert idx == list(range(idx[0], idx[0] + bs))  # one batch never wraps
        assert 1 <= idx[0] and idx[-1] <= fm.future_buffer_len  # index 0 is never handed out
        seen.append(idx[0])
    assert any(b < a for a, b in zip(seen, seen[1:]))  # 41 tokens > future_limit 24: it wrapped


@pytest.mark.parametrize("device", DEVICES)
def test_future_map_store_then_resolve(device):
    fm = FutureMap(8, None, 64, device)
    first = fm.alloc_future_indices(3)
    fm.store_to_map(first, torch.tensor([11, 12, 13], device=device))
    second = fm.alloc_future_indices(2)
    fm.store_to_map(second, torch.tensor([21, 22], device=device))
    mwb = _mwb([-first[2], 7, -second[0], -first[0], 5])
    fm.resolve_future(mwb)
    assert mwb.input_ids.device.type == device
    assert mwb.input_ids.tolist() == [13, 7, 21, 11, 5]


def test_resolve_without_futures_keeps_host_ids():
    fm = FutureMap(8, None, 64)
    mwb = _mwb([4, 5, 6])
    ids = mwb.input_ids
    fm.resolve_future(mwb)
    assert mwb.input_ids is ids  # nothing to resolve: no copy, no device work


def test_cpu_gets_the_thread_executor():
    fm = FutureMap(8, None, 64)
    executor = create_overlap_executor(FakeWorker(), fm, "cpu")
    try:
        assert isinstance(executor, ThreadOverlapExecutor)
    finally:
        executor.shutdown()


class DeferredCopyEvent:
    """Stands in for copy_done: the 'device-to-host copy' lands only when synchronize() is called."""

    def __init__(self, host: torch.Tensor, value: torch.Tensor) -> None:
        self.host, self.value = host, value
        self.synced = False

    def synchronize(self) -> None:
        self.host.copy_(self.value)
        self.synced = True


class DeferredCopyExecutor:
    """The CUDA executor's contract without CUDA: the forward runs at launch, in order; its tokens
    go into the FutureMap at once, but the host copy the result carries is garbage until
    copy_done.synchronize()."""

    def __init__(self, worker: FakeWorker, future_map: FutureMap) -> None:
        self.worker, self.future_map = worker, future_map
        self.events: list[DeferredCopyEvent] = []

    def launch(self, mwb: ModelWorkerBatch, future_indices: list[int]) -> LaunchedBatch:
        self.future_map.resolve_future(mwb)
        result: GenerationBatchResult = self.worker.forward_batch_generation(mwb)
        self.future_map.store_to_map(future_indices, result.next_token_ids)
        value = result.next_token_ids.clone()
        result.next_token_ids = torch.full_like(value, -999)
        result.copy_done = DeferredCopyEvent(result.next_token_ids, value)
        self.events.append(result.copy_done)
        return LaunchedBatch(result)

    def shutdown(self) -> None:
        return None


@pytest.mark.parametrize("args", [{}, {"chunked_prefill_size": 24, "enable_mixed_chunk": True}])
def test_results_wait_for_copy_done(make_harness, monkeypatch, args):
    """The scheduler reads a launched batch's tokens only after its copy_done event (else it would
    read the -999 placeholders), and outputs equal the normal loop's."""
    workload = random_workload(3, 30)
    normal = run_workload(make_harness, workload, worker=FakeWorker(max_total_num_tokens=1600), **args)
    executors: list[DeferredCopyExecutor] = []

    def fake_factory(worker: FakeWorker, fm: FutureMap, device: str) -> DeferredCopyExecutor:
        executors.append(DeferredCopyExecutor(worker, fm))
        return executors[-1]

    monkeypatch.setattr(scheduler_module, "create_overlap_executor", fake_factory)
    overlap = run_workload(
        make_harness,
        workload,
        worker=FakeWorker(max_total_num_tokens=1600),
        disable_overlap_schedule=False,
        **args,
    )
    assert overlap.outputs == normal.outputs
    assert overlap.finished == normal.finished
    (executor,) = executors
    assert executor.events and all(e.synced for e in executor.events)
    assert ("MIXED" in overlap.worker.forward_modes) == bool(args.get("enable_mixed_chunk"))


def test_future_map_fits_a_running_cap_raised_while_serving(make_harness):
    """The FutureMap is sized from the request rows (max_req_num), not from the start-up running
    cap: /set_internal_state may raise max_running_requests up to max_req_num, and a batch that wide
    must still get future slots that neither overflow the buffer nor wrap onto live ones."""
    h = make_harness(
        worker=FakeWorker(max_req_num=16), disable_overlap_schedule=False, max_running_requests=2
    )
    h.step([SetInternalStateReq(server_args={"max_running_requests": 16})])
    workload = random_workload(4, 16)
    for rid, ids, max_new in workload:
        h.submit(rid, ids, max_new)
    h.run_until_idle()
    for rid, ids, max_new in workload:
        assert h.outputs[rid] == reference_output(ids, max_new), rid
    assert max(h.worker.batch_sizes) > 2  # the raised cap was used
