"""What else touches a quantized KV pool keeps working: the HiCache host tier (L2 in the pool's
dtype: bf16, fp8) gives the same greedy outputs as without it, and speculative decoding over an
int8 pool (its scales move with their rows) gives the plain int8 run's outputs."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import SchedulerRun, serve_rounds, shared_prefix_workload
from spec_harness import SPEC, OracleDrafter, copy_workload, use_oracle

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_fused
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from radixserve.speculative.worker import SpeculativeWorker
from radixserve.testing.tiny_models import TINY_VOCAB

pytestmark = pytest.mark.skipif(not cpu_fused.ENABLED, reason="sgl_kernel._cpu not built")
POOL = 384  # two 150-token conversations fit, four do not: the host tier is needed


def _worker(path: str, kv: str, pool: int) -> tuple[TpModelWorker, ServerArgs]:
    args = ServerArgs(model_path=path, max_total_tokens=pool, device="cpu", kv_cache_dtype=kv).resolve()
    return TpModelWorker(args, ModelConfig.from_path(path, dtype="float32")), args


def _rounds(seed: int = 5, docs: int = 4, doc_len: int = 150) -> list[list[tuple[str, list[int], int]]]:
    rng = random.Random(seed)
    texts = [[rng.randrange(3, TINY_VOCAB) for _ in range(doc_len)] for _ in range(docs)]
    return [
        [(f"d{d}t{t}", texts[d] + [rng.randrange(3, TINY_VOCAB) for _ in range(5)], 5) for d in range(docs)]
        for t in range(2)
    ]


def _serve(worker: TpModelWorker, args: ServerArgs, rounds, **overrides) -> tuple[dict, dict]:
    run, state = serve_rounds(worker, args, rounds, max_running_requests=2, **overrides)
    return dict(run.outputs), state


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_host_tier_in_the_pool_dtype(tiny_llama_path, kv):
    worker, args = _worker(tiny_llama_path, kv, POOL)
    rounds = _rounds()
    base, _ = _serve(worker, args, rounds)
    tiered, state = _serve(worker, args, rounds, enable_hierarchical_cache=True, hicache_ratio=4)
    assert tiered == base
    tiers = state["hicache"]
    assert tiers["host_hit_tokens"] >= 150 and tiers["load_back_tokens"] >= 150, tiers


def test_speculative_over_an_int8_pool(tiny_llama_path):
    target, args = _worker(tiny_llama_path, "int8", 4096)
    worker = SpeculativeWorker(target, None)
    workload = shared_prefix_workload(seed=3, groups=2, per_group=3) + copy_workload(seed=3, n=4)
    plain = SchedulerRun(worker, args)
    for rid, prompt, n in workload:
        plain.submit(rid, prompt, n)
    plain.run_until_idle()
    reference = dict(plain.outputs)
    plain.close()
    run = SchedulerRun(worker, args, **SPEC)
    use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.15))
    for rid, prompt, n in workload:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    assert run.outputs == reference
    stats = run.scheduler.output.stats
    assert 0 < stats.spec_num_accepted < stats.spec_num_drafts
    run.close()
