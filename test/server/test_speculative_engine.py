"""Speculative decoding through the real processes (Engine, tiny model): the resolved flags reach
the scheduler and the worker, greedy output equals the plain engine's, and meta_info carries
SGLang's spec_* fields."""

from __future__ import annotations

import pytest
from real_helpers import random_ids

from radixserve import Engine


@pytest.mark.parametrize(
    "spec",
    [
        {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6},
        {"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 1},
    ],
    ids=["ngram", "self"],
)
def test_engine_speculation_matches_plain(spec, tiny_llama_path, tiny_engine):
    seg = random_ids(1, 20)
    prompts = [seg + random_ids(2, 5) + seg[:8], random_ids(3, 40)]
    params = {"temperature": 0.0, "max_new_tokens": 40}
    plain = tiny_engine.generate(input_ids=prompts, sampling_params=params)
    engine = Engine(model_path=tiny_llama_path, max_total_tokens=4096, **spec)
    try:
        assert engine.server_args.disable_overlap_schedule
        out = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in out] == [p["output_ids"] for p in plain]
    for o in out:
        meta = o["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_accept_length"] >= 1.0
        assert 0 <= meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
    assert "spec_verify_ct" not in plain[0]["meta_info"]
