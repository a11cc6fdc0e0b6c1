"""MoE models under tensor and pipeline parallelism through the Engine (gloo on 127.0.0.1): greedy
tokens equal HF transformers' and the single-rank engine's, logprobs within 1e-4 of the single
rank's (test_multi_rank_engine.py's workload and checks). At TP 2 each rank holds half of every
expert's intermediate dim (and of the shared expert's) and the router is replicated; OLMoE's
whole-width q/k norms all-reduce their sums of squares. The layers alone on two gloo ranks too."""

from __future__ import annotations

import pytest
import torch
from test_multi_rank_engine import _assert_matches, _prompts, _run, _until_eos

from radixserve.distributed.communication import TensorParallelComm
from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.moe.fused_moe_native import fused_experts_native
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.topk import select_experts
from radixserve.layers.norm import RMSNorm
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.weights import CheckpointTensor
from radixserve.models.olmoe import ShardedRMSNorm
from radixserve.testing.ranks import run_on_ranks
from radixserve.testing.tiny_models import hf_greedy

NEW = 20


@pytest.fixture(scope="module")
def moe_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[list[list[int]], list[dict]]] = {}

    def get(kind: str) -> tuple[list[list[int]], list[dict]]:
        if kind not in cache:
            path = tiny_model_dir(kind)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            first, second = _prompts()
            hf = [_until_eos(hf_greedy(model, p, NEW)[0]) for p in first + second]
            cache[kind] = (hf, _run(path))
        return cache[kind]

    return get


# make test runs EP 2 at TP 2 (the end-to-end check of the experts' all-reduce: whole experts on
# each rank, the shared expert and the dense layer between tensor-parallel); TP 2 alone (each
# expert's width split) is also checked layer by layer below. The slow ones add TP 2, PP 2 and
# TP x PP on other families: PP itself is the Llama decoder's, covered by test_multi_rank_engine.py.
LAYOUTS = [
    pytest.param("qwen2_moe", {"tp_size": 2, "ep_size": 2}, id="qwen2_moe-ep2"),
    pytest.param("qwen2_moe", {"tp_size": 2}, id="qwen2_moe-tp2", marks=pytest.mark.slow),
    pytest.param("mixtral", {"pp_size": 2}, id="mixtral-pp2", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", {"tp_size": 2, "pp_size": 2}, id="qwen3_moe-tp2pp2", marks=pytest.mark.slow),
    pytest.param("olmoe", {"tp_size": 2}, id="olmoe-tp2", marks=pytest.mark.slow),  # the sharded q/k norms
]


@pytest.mark.timeout(900)  # two Engines; TP 2 x PP 2 took 243 s on a busy 2-core box
@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_moe_greedy_parity_with_single_rank_and_hf(kind, layout, tiny_model_dir, moe_reference):
    hf, single = moe_reference(kind)
    _assert_matches(_run(tiny_model_dir(kind), **layout), hf, single)


@torch.no_grad()
def _moe_layers_on_rank(rank: int, world: int) -> dict[str, float]:
    """FusedMoE (this rank's slice of every expert, partial sums all-reduced) and OLMoE's sharded
    q/k norm against their unsharded references; every rank builds the same inputs."""
    import torch.distributed as dist

    tp = TensorParallelComm(rank, world, dist.group.WORLD)
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 6, 32, 16
    gate, up = (
        torch.randn(num_experts, inter, hidden, generator=gen),
        torch.randn(num_experts, inter, hidden, generator=gen),
    )
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    x = torch.randn(7, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(7, num_experts, generator=gen), 2, False)
    ref = fused_experts_native(x, torch.cat([gate, up], dim=1), down, weights, ids)
    errors = {}
    # TP: every expert's width split; EP: whole experts split (3 per rank), ids on both halves.
    for name, ep_size in (("experts", 1), ("experts_ep", world)):
        layer = FusedMoE(num_experts, hidden, inter, tp, ep_size)
        for e in range(num_experts):
            for proj, tensor in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
                param = layer.w2_weight if proj == "down_proj" else layer.w13_weight
                layer.weight_loader(param, CheckpointTensor.of(f"mlp.experts.{e}.{proj}.weight", tensor))
        errors[name] = float((layer(x, weights, ids) - ref).abs().max())
    assert layer.w13_weight.shape[0] == num_experts // world and layer.expert_start == rank * 3
    mine, other = (0, 5) if rank == 0 else (5, 0)
    assert layer.checkpoint_piece(f"mlp.experts.{other}.down_proj.weight", layer.w2_weight.data)[0] is None
    slot = layer.checkpoint_piece(f"mlp.experts.{mine}.down_proj.weight", layer.w2_weight.data)[0]
    errors["ep_slot"] = float((slot - down[mine]).abs().max())

    width, part = 32, 32 // world
    norm_weight, q = torch.rand(width, generator=gen) + 0.5, torch.randn(5, width, generator=gen)
    norm = ShardedRMSNorm(width, rank * part, part, 1e-6, tp)
    norm.weight_loader(norm.weight, CheckpointTensor.of("q_norm.weight", norm_weight))
    full = RMSNorm(width, 1e-6)
    full.weight.copy_(norm_weight)
    expected = full.forward_native(q)[:, rank * part : (rank + 1) * part]
    errors["q_norm"] = float((norm(q[:, rank * part : (rank + 1) * part]) - expected).abs().max())
    return errors


@pytest.mark.timeout(180)
def test_experts_and_olmoe_norm_sharded_over_two_ranks():
    for errors in run_on_ranks(_moe_layers_on_rank, 2):
        assert max(errors.values()) < 1e-4, errors


def test_olmoe_refuses_more_ranks_than_kv_heads(tiny_model_dir):
    """A replicated KV head would enter the k norm's all-reduced sum once per rank holding it."""
    from transformers import AutoConfig

    from radixserve.models.olmoe import OlmoeForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir("olmoe"))  # 2 KV heads
    parallel = ModelParallelism(tp=TensorParallelComm(rank=0, size=4))
    with torch.device("meta"), pytest.raises(ModelLoadError, match="tp-size 4"):
        OlmoeForCausalLM(config, parallel=parallel)
