"""LoRA adapters in a disaggregated pair (both schedulers in this process, real TCP transfer): both
sides load the same adapters, the prefill side computes the prompt's KV with the request's
adapter and the decode side decodes with it. Requests for three adapters and the base model, some
sharing a prompt, give a colocated scheduler's tokens (whose parity with HF + PEFT is
test/engine/test_lora_parity.py's), and the prefill side's radix cache never gives one adapter's
prefix to another."""

from __future__ import annotations

import random

import pytest

from radixserve.testing.inprocess import InProcessScheduler
from radixserve.testing.pd_pair import PDPair
from radixserve.testing.tiny_lora import TINY_ADAPTERS, make_tiny_adapter


@pytest.fixture
def lora_args(tiny_llama_path, tmp_path) -> dict:
    paths = [
        f"{n}={make_tiny_adapter(tiny_llama_path, n, tmp_path / n, seed=i)}"
        for i, n in enumerate(TINY_ADAPTERS)
    ]
    return {"enable_lora": True, "lora_paths": tuple(paths), "max_lora_rank": 16, "max_total_tokens": 4096}


@pytest.mark.timeout(600)
def test_adapters_through_a_pd_pair_match_colocated(tiny_llama_path, lora_args):
    rng = random.Random(6)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    names = [None, *TINY_ADAPTERS]
    # The same prompt under every adapter (and the base model), then one prompt each.
    reqs = [(f"s{i}", shared, name) for i, name in enumerate(names)]
    reqs += [
        (f"o{i}", [rng.randrange(3, 250) for _ in range(rng.randrange(5, 50))], n)
        for i, n in enumerate(names)
    ]
    ref = InProcessScheduler(tiny_llama_path, disable_overlap_schedule=True, **lora_args)
    try:
        for rid, ids, name in reqs:
            ref.submit(rid, ids, max_new_tokens=8, lora_id=name)
        want = {rid: r.output_ids for rid, r in ref.run_until_idle().items()}
    finally:
        ref.close()
    assert len({tuple(want[f"s{i}"]) for i in range(len(names))}) > 1  # the adapters change the tokens
    pair = PDPair(tiny_llama_path, prefill_args=lora_args, decode_args=lora_args)
    try:
        for room, (rid, ids, name) in enumerate(reqs, start=1):
            pair.submit(rid, ids, room=room, max_new_tokens=8, lora_id=name)
            pair.run_until_idle()  # one at a time: each later shared prompt meets the cached one
        got = {rid: r.output_ids for rid, r in pair.decode.results.items()}
        assert got == want
        assert pair.check_memory_leak() is None
    finally:
        pair.close()
