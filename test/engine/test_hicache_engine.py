"""HiCache over the real TpModelWorker (tiny llama): conversations whose documents exceed the KV
pool give token-identical greedy outputs with and without the host tier, and the tier is hit
(prefixes the pool evicted are loaded back from L2 instead of recomputed)."""

import random

import pytest
from scheduler_harness import WorkerCache, serve_rounds

from radixserve.testing.tiny_models import TINY_VOCAB

POOL = 384  # device KV pool: two 150-token conversations fit, six do not


def conversation_rounds(seed: int = 3, docs: int = 6, doc_len: int = 150, turns: int = 3):
    rng = random.Random(seed)
    texts = [[rng.randrange(3, TINY_VOCAB) for _ in range(doc_len)] for _ in range(docs)]
    return [
        [(f"d{d}t{t}", texts[d] + [rng.randrange(3, TINY_VOCAB) for _ in range(6)], 6) for d in range(docs)]
        for t in range(turns)
    ]


ROUNDS = conversation_rounds()


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    return WorkerCache(tiny_model_dir)


def serve(workers, page_size: int, **overrides) -> tuple[dict[str, list[int]], dict, dict[str, int]]:
    worker, args = workers.get("llama", page_size, POOL)
    run, state = serve_rounds(worker, args, ROUNDS, max_running_requests=2, **overrides)
    return run.outputs, state, run.cached_tokens


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunked", [64, -1], ids=["chunk64", "nochunk"])
def test_outputs_identical_with_and_without_the_host_tier(workers, page_size, chunked):
    base, base_state, base_cached = serve(workers, page_size, chunked_prefill_size=chunked)
    tiered, state, cached = serve(
        workers, page_size, chunked_prefill_size=chunked, enable_hierarchical_cache=True, hicache_ratio=4
    )
    assert len(base) == sum(len(b) for b in ROUNDS)
    diff = {rid: (base[rid], tiered.get(rid)) for rid in base if base[rid] != tiered.get(rid)}
    assert not diff, diff
    tiers = state["hicache"]
    assert tiers["host_hit_tokens"] >= 150 and tiers["load_back_tokens"] >= 150, tiers
    # Every follow-up turn reuses its document (from L2 where the pool had evicted it); without
    # the tier most are recomputed.
    follow_ups = [rid for batch in ROUNDS[1:] for rid, _, _ in batch]
    assert all(cached[rid] >= 150 // page_size * page_size for rid in follow_ups), cached
    assert sum(base_cached[rid] for rid in follow_ups) < sum(cached[rid] for rid in follow_ups) / 2
