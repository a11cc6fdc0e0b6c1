"""Draft trees through the Triton attention backend, end to end on the real TpModelWorker (tiny
model): an oracle tree verified with the Triton extend kernel's tree mask gives greedy output
token-identical to plain decoding on the same backend, and the pool ends full.

Without a CUDA device the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here
before triton is imported), which costs per element: the workload is three short requests."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")

from scheduler_harness import SchedulerRun, shared_prefix_workload  # noqa: E402
from spec_harness import SPEC, OracleTreeDrafter, Workers, use_oracle  # noqa: E402

STANDALONE_TREE = {
    "speculative_algorithm": "STANDALONE",
    "speculative_num_draft_tokens": 7,
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 2,
    "disable_speculative_batch_backoff": True,
}
# Two requests sharing a system prefix (a radix hit for the second) and a third on its own.
WORKLOAD = [(rid, prompt, 10) for rid, prompt, _ in shared_prefix_workload(seed=5, groups=2, per_group=2)][:3]


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    return Workers(tiny_model_dir)


def _run(workers: Workers, page_size: int, oracle: dict | None = None) -> tuple[dict, SchedulerRun]:
    worker, args = workers.get("llama", "triton", page_size)
    run = SchedulerRun(worker, args, **(SPEC if oracle is not None else {}))
    if oracle is not None:
        use_oracle(run, OracleTreeDrafter(oracle, max_drafts=5, error_rate=0.2))
    for rid, prompt, n in WORKLOAD:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    return dict(run.outputs), run


# make test-all only (docs/testing.md): test/kernels/test_triton_attention.py checks the Triton
# backend's tree verify against torch_native on the same batch (page sizes 1 and 16), and
# test_speculative_trees.py these oracle trees end to end on the other backends.
@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_oracle_trees_are_exact(workers, page_size):
    reference, plain = _run(workers, page_size)
    plain.close()
    assert all(len(reference[rid]) == n for rid, _, n in WORKLOAD)
    outputs, run = _run(workers, page_size, oracle=reference)
    assert outputs == reference
    stats = run.scheduler.output.stats
    assert 0 < stats.spec_num_accepted < stats.spec_num_drafts  # trees with rejected branches
    run.close()  # asserts no KV slot or row leaked


@pytest.mark.slow  # make test-all only (docs/testing.md): the oracle tree covers the kernel's tree mask
def test_triton_self_speculation_trees_are_exact(workers):
    """STANDALONE trees drafted by the target's first layer: the draft's own tree passes (extends
    with the tree mask) run through the Triton kernel too."""
    from radixserve.speculative.layer_skip_draft import LayerSkipDraft

    reference, plain = _run(workers, 16)
    plain.close()
    worker, args = workers.get("llama", "triton", 16)
    worker.draft = LayerSkipDraft(worker.inner.model_runner, 1, topk=2, num_steps=3)
    try:
        run = SchedulerRun(worker, args, **STANDALONE_TREE)
        for rid, prompt, n in WORKLOAD:
            run.submit(rid, prompt, n)
        run.run_until_idle()
        assert dict(run.outputs) == reference
        stats = run.scheduler.output.stats
        assert stats.spec_num_rounds > 0 and stats.spec_num_drafts > 0
        run.close()
    finally:
        worker.draft = None
