"""Overlap on CUDA (model_executor/overlap_cuda.py) with decode CUDA graphs, on tiny models: the
scheduler's greedy outputs equal HF's and the normal loop's, and launching a decode forward never
synchronises the host with the device. GPU only: skipped without CUDA (CPU coverage of the same
contract is in test/unit/test_overlap.py)."""

import pytest
import torch
from scheduler_harness import SchedulerRun, shared_prefix_workload, until_eos

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_models import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WORKLOAD = shared_prefix_workload(seed=3, groups=2, per_group=6)


@pytest.fixture(scope="module")
def cuda_worker(tiny_model_dir):
    path = tiny_model_dir("llama")
    # fp32 so greedy tokens can be compared with HF exactly; graphs on (the CUDA default).
    args = ServerArgs(
        model_path=path,
        max_total_tokens=8192,
        device="cuda",
        attention_backend="triton",
        cuda_graph_max_bs=16,
    ).resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
    assert worker.model_runner.graph_runner is not None
    return worker, args


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    return {rid: until_eos(hf_greedy(model, p, n)[0]) for rid, p, n in WORKLOAD}


def _run(worker, args, overlap: bool) -> SchedulerRun:
    run = SchedulerRun(worker, args, disable_overlap_schedule=not overlap, chunked_prefill_size=32)
    for rid, ids, max_new in WORKLOAD:
        run.submit(rid, ids, max_new)
    return run


def test_overlap_on_streams_matches_hf_and_normal(cuda_worker, reference):
    from radixserve.model_executor.overlap_cuda import CudaStreamOverlapExecutor

    worker, args = cuda_worker
    outputs = {}
    for overlap in (False, True):
        run = _run(worker, args, overlap)
        if overlap:
            assert isinstance(run.loop.executor.worker, CudaStreamOverlapExecutor)
        run.run_until_idle()
        run.close()
        outputs[overlap] = run.outputs
    assert outputs[True] == outputs[False] == reference


def test_decode_launch_never_syncs_the_host(cuda_worker, monkeypatch):
    """torch's sync debug mode raises on any host<->device synchronisation: a greedy decode launch
    (FutureMap resolve, graph replay, sample, store, async copy, event) must contain none."""
    worker, args = cuda_worker
    run = _run(worker, args, overlap=True)
    executor = run.loop.executor.worker
    real_launch = executor.launch
    checked = []

    def checked_launch(mwb, future_indices):
        if not (mwb.forward_mode.is_decode() and not mwb.return_logprob):
            return real_launch(mwb, future_indices)
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = real_launch(mwb, future_indices)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(mwb.batch_size)
        return launched

    monkeypatch.setattr(executor, "launch", checked_launch)
    try:
        run.run_until_idle()
        run.close()
    finally:
        if not run.closed:
            run.force_clean()
    assert checked, "no decode batch was launched"
