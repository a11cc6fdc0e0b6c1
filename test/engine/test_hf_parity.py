"""Engine core vs HF transformers: greedy tokens identical, logprobs within 1e-4."""

import random

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy

NUM_NEW = 32


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 70))] for _ in range(8)]


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(kind: str) -> list[tuple[list[int], list[float]]]:
        if kind not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(kind), dtype=torch.float32).eval()
            cache[kind] = [hf_greedy(model, p, NUM_NEW) for p in _prompts(0)]
        return cache[kind]

    return get


def _runner(path: str, page_size: int) -> StaticBatchRunner:
    args = ServerArgs(model_path=path, max_total_tokens=4096, page_size=page_size, device="cpu").resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
    return StaticBatchRunner(worker, return_logprob=True)


def _greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NUM_NEW, temperature=0.0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_parity_with_prefix_reuse(kind, page_size, tiny_model_dir, hf_reference):
    runner = _runner(tiny_model_dir(kind), page_size)
    reference = hf_reference(kind)
    prompts = _prompts(0)
    reqs = [StaticReq(p, _greedy()) for p in prompts]
    runner.generate(reqs, NUM_NEW)
    for req, (ref_ids, ref_logprobs) in zip(reqs, reference):
        assert req.output_ids == ref_ids
        assert max(abs(a - b) for a, b in zip(req.output_logprobs, ref_logprobs)) < 1e-4

    # Second round: half of each prompt's KV comes from the first round's slots (page-aligned,
    # as the radix cache shares it), only the rest is computed.
    reused = [
        StaticReq(p, _greedy(), prefix_slots=runner.slots_of(r, len(p) // 2 // page_size * page_size))
        for p, r in zip(prompts, reqs)
    ]
    assert any(len(r.prefix_slots) > 0 for r in reused)
    available = runner.worker.pools.token_to_kv_pool_allocator.available_size()
    runner.generate(reused, NUM_NEW)
    for req, (ref_ids, ref_logprobs) in zip(reused, reference):
        assert req.output_ids == ref_ids
        assert max(abs(a - b) for a, b in zip(req.output_logprobs, ref_logprobs)) < 1e-4
    runner.release(reused)
    assert runner.worker.pools.token_to_kv_pool_allocator.available_size() == available
