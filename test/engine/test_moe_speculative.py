"""Speculative decoding on MoE models (tiny Qwen2-MoE with its shared expert, Qwen3-MoE top-8):
verify steps route every draft token through the experts like any other token, so greedy output is
plain decoding's exactly, with NGRAM drafts and with an oracle drafter that is right or wrong at
will; no KV slot or row leaks."""

from __future__ import annotations

import pytest
from scheduler_harness import shared_prefix_workload
from spec_harness import SPEC, OracleDrafter, copy_workload, use_oracle

WORKLOAD = shared_prefix_workload(seed=4, groups=2, per_group=3) + copy_workload(seed=4, n=4)


def _plain(make_run, kind: str) -> dict[str, list[int]]:
    run = make_run("cpu", 16, kind=kind)
    for rid, prompt, n in WORKLOAD:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    outputs = dict(run.outputs)
    run.close()
    return outputs


@pytest.mark.parametrize(
    "kind",
    ["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow)],  # slow: same path, + shared expert
)
def test_ngram_and_oracle_drafts_are_exact_on_moe(kind, make_run):
    reference = _plain(make_run, kind)
    run = make_run("cpu", 16, kind=kind, **SPEC)
    for rid, prompt, n in WORKLOAD:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    assert run.outputs == reference
    assert run.scheduler.output.stats.spec_num_rounds > 0
    run.close()  # asserts no KV slot or row leaked

    run = make_run("cpu", 16, kind=kind, **SPEC)
    use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.2))
    for rid, prompt, n in WORKLOAD:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    assert run.outputs == reference
    stats = run.scheduler.output.stats
    assert 0 < stats.spec_num_accepted < stats.spec_num_drafts
    run.close()
