"""Data parallelism through the Engine: --dp-size 2 gives the same greedy tokens and logprobs as
one replica, whatever the dispatch method, on tiny random llama / qwen3 models (page_size 16,
chunked prefill, radix hits), and with each replica a TP=2 group (four ranks, two worlds)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from radixserve import Engine
from radixserve.testing.tiny_models import TINY_VOCAB

pytestmark = pytest.mark.timeout(600)

NEW = 16
ARGS = {"max_total_tokens": 4096, "page_size": 16, "chunked_prefill_size": 64, "log_level": "warning"}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    groups = [[rng.randrange(3, TINY_VOCAB) for _ in range(48)] for _ in range(3)]
    # Three groups sharing 48-token prefixes (radix hits), plus a long prompt in 3 chunks.
    prompts = [
        g + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(1, 9))]
        for g in groups
        for _ in range(3)
    ]
    return prompts + [[rng.randrange(3, TINY_VOCAB) for _ in range(150)]]


def _run(path: str, **kw: Any) -> tuple[list[dict], list[dict]]:
    with Engine(model_path=path, **ARGS, **kw) as engine:
        outs = []
        for prompt in (_prompts()[:4], _prompts()[4:]):  # two rounds: the second hits the cache
            outs += engine.generate(
                input_ids=prompt,
                sampling_params={"max_new_tokens": NEW, "temperature": 0},
                return_logprob=True,
            )
        states = engine._run(engine.tokenizer_manager.get_internal_states())
    return outs, states


def _assert_same(outs: list[dict], ref: list[dict]) -> None:
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    for o, r in zip(outs, ref):
        got = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        want = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    cache: dict[str, list[dict]] = {}

    def get(kind: str) -> list[dict]:
        if kind not in cache:
            cache[kind] = _run(tiny_model_dir(kind))[0]
        return cache[kind]

    return get


@pytest.mark.parametrize(
    "kind, method",
    # make test runs cache_aware (round_robin is test_data_parallel_server.py's policy); the rest,
    # in make test-all, are other policies whose choices test/unit/test_dp_policy.py checks.
    [
        pytest.param("llama", "round_robin", marks=pytest.mark.slow),
        ("llama", "cache_aware"),
        pytest.param("qwen3", "shortest_queue", marks=pytest.mark.slow),
        pytest.param("qwen3", "minimum_tokens", marks=pytest.mark.slow),
    ],
)
def test_dp2_matches_one_replica(kind, method, tiny_model_dir, single):
    outs, states = _run(tiny_model_dir(kind), dp_size=2, load_balance_method=method)
    _assert_same(outs, single(kind))
    assert [s["dp_rank"] for s in states] == [0, 1]
    # Both replicas served prompts (every method spreads 10 prompts over two idle replicas) and
    # both pools are whole again.
    assert all(s["cache_query_tokens"] > 0 for s in states), states
    for s in states:
        (pool,) = s["ranks"]
        assert pool["available_tokens"] + pool["evictable_tokens"] == pool["max_total_num_tokens"]
        assert pool["memory_leak"] is None


@pytest.mark.slow  # make test-all only (docs/testing.md): dp2 and tp2 each run in make test
def test_dp2_of_tp2_groups_matches_one_replica(tiny_model_dir, single):
    outs, states = _run(tiny_model_dir("llama"), dp_size=2, tp_size=2, load_balance_method="round_robin")
    _assert_same(outs, single("llama"))
    assert [len(s["ranks"]) for s in states] == [2, 2]  # each replica is a TP=2 group
