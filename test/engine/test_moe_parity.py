"""MoE architectures (tiny random Qwen2-MoE with a shared expert and a dense layer, Qwen3-MoE top-8
renormalised, Mixtral top-2, OLMoE top-1 with clip_qkv) vs HF transformers: greedy tokens
identical and logprobs within 1e-4, at page size 1 and 16, with prefix reuse; and under the real
scheduler with chunked prefill, the radix cache and the overlap loop."""

import random

import pytest
import torch
from scheduler_harness import SchedulerRun, WorkerCache, shared_prefix_workload, until_eos

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.cpu_decode_runner import create_cpu_decode_runner
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.models.llama import LlamaMLP
from radixserve.models.moe_decoder import SparseMoeBlock
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_models import MOE_KINDS, TINY_VOCAB, hf_greedy

NUM_NEW = 16
WORKLOAD = shared_prefix_workload(seed=2, groups=2, per_group=4)  # 8 requests, 2 shared prefixes
CHUNK = 32  # below the longest prompts (up to 80 tokens): they prefill in several chunks


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 70))] for _ in range(5)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    models = {}

    def get(kind: str):
        if kind not in models:
            models[kind] = AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(kind), dtype=torch.float32
            ).eval()
        return models[kind]

    return get


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    """HF greedy tokens and logprobs of every _prompts(0) prompt, per model (made once)."""
    cache = {}

    def get(kind: str) -> list[tuple[list[int], list[float]]]:
        if kind not in cache:
            cache[kind] = [hf_greedy(hf_model(kind), p, NUM_NEW) for p in _prompts(0)]
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    return WorkerCache(tiny_model_dir)


def _greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NUM_NEW, temperature=0.0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_greedy_parity_with_prefix_reuse(kind, page_size, workers, hf_reference):
    worker, _ = workers.get(kind, page_size)
    runner = StaticBatchRunner(worker, return_logprob=True)
    prompts = _prompts(0)
    reference = hf_reference(kind)
    reqs = [StaticReq(p, _greedy()) for p in prompts]
    runner.generate(reqs, NUM_NEW)
    for req, (ref_ids, ref_logprobs) in zip(reqs, reference):
        assert req.output_ids == ref_ids
        assert max(abs(a - b) for a, b in zip(req.output_logprobs, ref_logprobs)) < 1e-4
    # Half of each prompt's KV from the first round (page-aligned, as the radix cache shares it).
    reused = [
        StaticReq(p, _greedy(), prefix_slots=runner.slots_of(r, len(p) // 2 // page_size * page_size))
        for p, r in zip(prompts, reqs)
    ]
    runner.generate(reused, NUM_NEW)
    assert [r.output_ids for r in reused] == [ids for ids, _ in reference]
    runner.release(reqs)
    runner.release(reused)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_scheduler_chunked_prefill_radix_matches_hf(kind, workers, hf_model):
    worker, args = workers.get(kind, 16)
    run = SchedulerRun(worker, args, disable_overlap_schedule=False, chunked_prefill_size=CHUNK)
    try:
        for rid, prompt, max_new in WORKLOAD:
            run.submit(rid, prompt, max_new)
        run.run_until_idle()
        model = hf_model(kind)
        reference = {rid: until_eos(hf_greedy(model, p, n)[0]) for rid, p, n in WORKLOAD}
        assert run.outputs == reference
        assert sum(1 for c in run.cached_tokens.values() if c > 0) >= 2, run.cached_tokens
        run.close()
    finally:
        if not run.closed:
            run.force_clean()


def test_qwen2_moe_layers_follow_the_config(tiny_model_dir):
    """mlp_only_layers=[1]: layer 1 keeps a dense MLP; the others are sparse with the shared
    expert and its gate. The CPU fused decode stack (dense MLPs only) is not used."""
    path = tiny_model_dir("qwen2_moe")
    args = ServerArgs(model_path=path, max_total_tokens=1024, device="cpu").resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
    runner = worker.model_runner
    layers = runner.model.model.layers
    assert isinstance(layers[1].mlp, LlamaMLP)
    for i in (0, 2):
        block = layers[i].mlp
        assert isinstance(block, SparseMoeBlock)
        assert block.shared_expert is not None and block.shared_expert_gate is not None
        assert tuple(block.experts.w13_weight.shape) == (8, 64, 64)
        assert tuple(block.experts.w2_weight.shape) == (8, 64, 32)
    assert runner.cpu_decode_runner is None
    assert create_cpu_decode_runner(runner.model, runner.token_to_kv_pool, args) is None


def test_expert_weights_update_and_read_back_by_checkpoint_name(tiny_model_dir):
    """Weight updates by checkpoint name reach one expert's slot of the stacked weights, and
    /get_weights_by_name's reader answers with that expert's tensor, not the whole stack."""
    from safetensors import safe_open

    from radixserve.model_executor.weight_read import assemble, read_piece

    path = tiny_model_dir("mixtral")
    args = ServerArgs(model_path=path, max_total_tokens=1024, device="cpu").resolve()
    model = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32")).model_runner.model
    names = [f"model.layers.1.block_sparse_moe.experts.2.{p}.weight" for p in ("w1", "w2", "w3")]
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for name in names:
            piece = read_piece(model, name, 1000)
            assert torch.equal(assemble([piece], 1000), f.get_tensor(name))
    new = torch.full((64, 48), 0.5)  # w2: [hidden, intermediate]
    model.load_weights([(names[1], new)], require_all=False)
    assert torch.equal(model.model.layers[1].mlp.experts.w2_weight[2], new)
    assert torch.equal(assemble([read_piece(model, names[1], 10)], 10), new[:10])
    assert not torch.equal(model.model.layers[1].mlp.experts.w2_weight[1], new)


def test_sparse_layer_choice_and_refusals():
    """Qwen-MoE's decoder_sparse_step / mlp_only_layers pick the sparse layers as HF does; a
    Mixtral sliding window shorter than the context is refused (attention here is always full)."""
    from types import SimpleNamespace

    from radixserve.model_loader.errors import ModelLoadError
    from radixserve.models.mixtral import MixtralForCausalLM
    from radixserve.models.moe_decoder import MoeDecoderLayer

    config = SimpleNamespace(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [MoeDecoderLayer.is_sparse(config, i) for i in range(6)] == [
        False,
        True,
        False,
        False,
        False,
        True,
    ]
    config.num_experts = 0
    assert not any(MoeDecoderLayer.is_sparse(config, i) for i in range(6))
    with pytest.raises(ModelLoadError, match="sliding_window"):
        MixtralForCausalLM(SimpleNamespace(sliding_window=128, max_position_embeddings=4096))
