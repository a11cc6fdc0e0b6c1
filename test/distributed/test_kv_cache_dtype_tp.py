"""--kv-cache-dtype int8 at TP 2: each rank holds its KV heads' int8 rows and their scales (one per
token and KV head, so sharding heads leaves them whole); greedy tokens equal the single rank's
int8 run and logprobs agree within 1e-3 (TP 2 adds partial sums in another order, and a K/V
value on an int8 rounding boundary may then round the other way: one step of amax/127)."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine
from radixserve.testing.tiny_models import TINY_VOCAB

ARGS = {"max_total_tokens": 4096, "page_size": 16, "log_level": "warning", "kv_cache_dtype": "int8"}
PARAMS = {"max_new_tokens": 16, "temperature": 0}


def _run(path: str, tp_size: int) -> list[dict]:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(8, 120))] for _ in range(5)]
    with Engine(model_path=path, tp_size=tp_size, **ARGS) as engine:
        return engine.generate(input_ids=prompts, sampling_params=PARAMS, return_logprob=True)


# make test-all only (docs/testing.md): int8 KV at one rank (test_kv_cache_dtype.py,
# test_kv_cache_dtype_server.py) and fp32 KV at TP 2 (test_multi_rank_engine.py) cover its parts.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_int8_kv_tp2_matches_one_rank(tiny_model_dir):
    path = tiny_model_dir("llama")
    one, two = _run(path, 1), _run(path, 2)
    for a, b in zip(one, two):
        assert a["output_ids"] == b["output_ids"]
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-3
