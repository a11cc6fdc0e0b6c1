"""The MoE kernels against the torch-native reference (dense masks), on random shapes: top-k 1, 2
and 8, renormalised or not, experts that get no tokens, fp32 and bf16; the router's top-k against
a plain softmax + sort; and FusedMoE's per-expert checkpoint loading."""

import pytest
import torch

from radixserve.layers.moe.fused_moe_cpu import fused_experts_grouped
from radixserve.layers.moe.fused_moe_native import fused_experts_native
from radixserve.layers.moe.layer import FusedMoE, expert_param_name
from radixserve.layers.moe.topk import select_experts
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.weights import CheckpointTensor


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def _route(num_tokens: int, num_experts: int, top_k: int, renorm: bool, gen: torch.Generator):
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    return select_experts(logits, top_k, renorm)


CASES = [
    # (num_tokens, num_experts, top_k, hidden, inter)
    (1, 8, 1, 64, 32),
    (1, 128, 8, 128, 48),  # decode at Qwen3-MoE's routing width: 120 experts idle
    (5, 16, 2, 96, 40),
    (37, 8, 2, 64, 24),
    (64, 16, 8, 32, 16),
    (200, 4, 1, 48, 64),
]


@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "norenorm"])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}" for c in CASES])
def test_grouped_matches_native_fp32(case, renorm):
    num_tokens, num_experts, top_k, hidden, inter = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _route(num_tokens, num_experts, top_k, renorm, gen)
    got = fused_experts_grouped(x, w13, w2, weights, ids)
    ref = fused_experts_native(x, w13, w2, weights, ids)
    assert got.shape == (num_tokens, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", CASES[1:4], ids=[f"T{c[0]}-E{c[1]}-k{c[2]}" for c in CASES[1:4]])
def test_grouped_matches_native_bf16(case):
    num_tokens, num_experts, top_k, hidden, inter = case
    gen = torch.Generator().manual_seed(7)
    w13, w2 = _weights(num_experts, hidden, inter, torch.bfloat16, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    weights, ids = _route(num_tokens, num_experts, top_k, True, gen)
    got = fused_experts_grouped(x, w13, w2, weights, ids)
    ref = fused_experts_native(x, w13, w2, weights, ids)  # fp32 math, rounded once to bf16
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa; the kernel rounds its intermediates, the reference does not.
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_experts_without_tokens_and_lopsided_routing():
    """Every token routed to the same two of 16 experts (14 get nothing), and one expert that
    only one token picked: the grouped kernel's slices must still line up with the reference."""
    gen = torch.Generator().manual_seed(3)
    w13, w2 = _weights(16, 32, 16, torch.float32, gen)
    x = torch.randn(9, 32, generator=gen)
    ids = torch.tensor([[5, 11]] * 8 + [[11, 0]])
    weights = torch.rand(9, 2, generator=gen)
    got = fused_experts_grouped(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_experts_native(x, w13, w2, weights, ids), atol=2e-5, rtol=1e-4)
    # Poison the experts nobody chose: the result must not change (they are never read).
    w13[[1, 2, 3, 15]] = float("nan")
    torch.testing.assert_close(fused_experts_grouped(x, w13, w2, weights, ids), got, atol=0, rtol=0)


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("case", CASES[1:5], ids=[f"T{c[0]}-E{c[1]}-k{c[2]}" for c in CASES[1:5]])
def test_expert_shards_add_up_to_the_layer(case, shards):
    """Expert parallelism: each shard runs only its experts' (token, expert) pairs; the shards'
    outputs add up to the whole layer's (what the all-reduce does), including shards none of
    whose experts a token chose."""
    num_tokens, num_experts, top_k, hidden, inter = case
    gen = torch.Generator().manual_seed(11)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _route(num_tokens, num_experts, top_k, True, gen)
    n = num_experts // shards
    parts = [
        fused_experts_grouped(x, w13[s * n : (s + 1) * n], w2[s * n : (s + 1) * n], weights, ids, s * n)
        for s in range(shards)
    ]
    ref = fused_experts_native(x, w13, w2, weights, ids)
    torch.testing.assert_close(sum(parts), ref, atol=2e-5, rtol=1e-4)
    for s, part in enumerate(parts):  # each shard alone: the reference over its experts only
        mine = ((ids >= s * n) & (ids < (s + 1) * n)).float()
        alone = fused_experts_native(x, w13, w2, weights * mine, ids)
        torch.testing.assert_close(part, alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_expert_weights_load_and_read_back_at_any_ep_layout(ep_size):
    """TP 4 with --ep-size 1 (every expert's width in 4), 2 (experts in halves, width in 2) and 4
    (whole experts): each rank loads only its part, and the ranks' pieces assemble into the
    checkpoint tensor (/get_weights_by_name), the ranks without the expert holding none."""
    from radixserve.distributed.communication import TensorParallelComm
    from radixserve.model_executor.weight_read import WeightPiece, assemble

    gen = torch.Generator().manual_seed(5)
    num_experts, hidden, inter = 8, 16, 24
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    up = torch.randn(num_experts, inter, hidden, generator=gen)
    layers = [
        FusedMoE(num_experts, hidden, inter, TensorParallelComm(rank=r, size=4), ep_size) for r in range(4)
    ]
    for layer in layers:
        assert layer.w2_weight.shape == (num_experts // ep_size, hidden, inter * ep_size // 4)
        for e in range(num_experts):
            for proj, t, param in (
                ("down_proj", down[e], layer.w2_weight),
                ("up_proj", up[e], layer.w13_weight),
            ):
                layer.weight_loader(param, CheckpointTensor.of(f"mlp.experts.{e}.{proj}.weight", t))
    for e in range(num_experts):
        for proj, full, attr in (("down_proj", down[e], "w2_weight"), ("up_proj", up[e], "w13_weight")):
            name = f"mlp.experts.{e}.{proj}.weight"
            found = [layer.checkpoint_piece(name, getattr(layer, attr).data) for layer in layers]
            assert sum(slot is not None for slot, *_ in found) == 4 // ep_size
            pieces = [None if slot is None else WeightPiece(slot, *rest) for slot, *rest in found]
            torch.testing.assert_close(assemble(pieces, full.shape[0]), full, atol=0, rtol=0)


def test_zero_tokens():
    gen = torch.Generator().manual_seed(4)
    w13, w2 = _weights(4, 16, 8, torch.float32, gen)
    out = fused_experts_grouped(
        torch.empty(0, 16), w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long)
    )
    assert out.shape == (0, 16)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("renorm", [True, False])
def test_select_experts(top_k, renorm):
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(13, 16, generator=gen)
    weights, ids = select_experts(logits, top_k, renorm)
    probs = torch.softmax(logits.double(), dim=-1)
    expected_ids = probs.argsort(dim=-1, descending=True)[:, :top_k]
    assert torch.equal(ids, expected_ids)
    expected = probs.gather(1, expected_ids)
    if renorm:
        expected = expected / expected.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(weights.sum(dim=-1), torch.ones(13), atol=1e-6, rtol=0)
    torch.testing.assert_close(weights.double(), expected, atol=1e-6, rtol=1e-6)
    assert weights.dtype == torch.float32


def test_select_experts_bf16_logits_route_in_fp32():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weights, ids = select_experts(logits, 2, False)
    ref_w, ref_ids = torch.topk(torch.softmax(logits.float(), dim=-1), 2, dim=-1)
    assert weights.dtype == torch.float32 and torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


class _Single:
    rank, size = 0, 1


class _Rank:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def test_expert_param_names():
    assert (
        expert_param_name("model.layers.3.mlp.experts.7.gate_proj.weight")
        == "model.layers.3.mlp.experts.w13_weight"
    )
    assert (
        expert_param_name("model.layers.3.mlp.experts.7.up_proj.weight")
        == "model.layers.3.mlp.experts.w13_weight"
    )
    assert (
        expert_param_name("model.layers.0.mlp.experts.12.down_proj.weight")
        == "model.layers.0.mlp.experts.w2_weight"
    )
    assert (
        expert_param_name("model.layers.0.mlp.experts.1.w2.weight") == "model.layers.0.mlp.experts.w2_weight"
    )
    assert (
        expert_param_name("model.layers.0.mlp.experts.1.w3.weight") == "model.layers.0.mlp.experts.w13_weight"
    )
    assert expert_param_name("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    assert expert_param_name("model.layers.0.mlp.gate.weight") is None


@pytest.mark.parametrize("tp_size", [1, 2])
def test_weight_loader_stacks_and_shards_experts(tp_size):
    """Per-expert gate/up/down tensors land in the stacked weights; a TP rank holds its slice of
    every expert's intermediate dim, and the ranks' partial outputs sum to the whole layer's."""
    gen = torch.Generator().manual_seed(5)
    num_experts, hidden, inter = 4, 16, 8
    gate = torch.randn(num_experts, inter, hidden, generator=gen)
    up = torch.randn(num_experts, inter, hidden, generator=gen)
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    x = torch.randn(5, hidden, generator=gen)
    weights, ids = _route(5, num_experts, 2, True, gen)
    full_w13 = torch.cat([gate, up], dim=1)
    expected = fused_experts_native(x, full_w13, down, weights, ids)
    total = torch.zeros_like(expected)
    for rank in range(tp_size):
        layer = FusedMoE(num_experts, hidden, inter, _Rank(rank, tp_size))
        for e in range(num_experts):
            for proj, tensor in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
                name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
                param = layer.w2_weight if proj == "down_proj" else layer.w13_weight
                layer.weight_loader(param, CheckpointTensor.of(name, tensor))
        total += fused_experts_grouped(x, layer.w13_weight.data, layer.w2_weight.data, weights, ids)
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)


def test_weight_loader_refuses_wrong_shapes_and_experts():
    layer = FusedMoE(2, 16, 8, _Single())
    with pytest.raises(ModelLoadError, match="Shape mismatch"):
        layer.weight_loader(
            layer.w13_weight, CheckpointTensor.of("m.experts.0.gate_proj.weight", torch.zeros(9, 16))
        )
    with pytest.raises(ModelLoadError, match="expert 2"):
        layer.weight_loader(
            layer.w13_weight, CheckpointTensor.of("m.experts.2.up_proj.weight", torch.zeros(8, 16))
        )


@pytest.mark.parametrize("ep_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["transformers", "original"])
def test_stacked_expert_tensors_load_as_the_per_expert_ones(ep_size, layout):
    """Qwen3-VL-MoE's stacked `experts.gate_up_proj` / `experts.down_proj`, in transformers 5's
    layout or the original release's (transposed), fill every rank of TP 4 at each --ep-size
    exactly as the same weights given one tensor per expert do; a wrong shape is refused."""
    from radixserve.distributed.communication import TensorParallelComm

    gen = torch.Generator().manual_seed(6)
    num_experts, hidden, inter = 8, 16, 24
    gate, up = torch.randn(2, num_experts, inter, hidden, generator=gen)
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    gate_up, down_stacked = torch.cat([gate, up], dim=1), down  # [E, 2I, H], [E, H, I]
    if layout == "original":
        gate_up, down_stacked = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    for r in range(4):
        stacked = FusedMoE(num_experts, hidden, inter, TensorParallelComm(rank=r, size=4), ep_size)
        per_expert = FusedMoE(num_experts, hidden, inter, TensorParallelComm(rank=r, size=4), ep_size)
        stacked.load_stacked(stacked.w13_weight, CheckpointTensor.of("mlp.experts.gate_up_proj", gate_up))
        stacked.load_stacked(stacked.w2_weight, CheckpointTensor.of("mlp.experts.down_proj", down_stacked))
        for e in range(num_experts):
            for proj, t, param in (
                ("gate_proj", gate[e], per_expert.w13_weight),
                ("up_proj", up[e], per_expert.w13_weight),
                ("down_proj", down[e], per_expert.w2_weight),
            ):
                per_expert.weight_loader(param, CheckpointTensor.of(f"mlp.experts.{e}.{proj}.weight", t))
        torch.testing.assert_close(stacked.w13_weight, per_expert.w13_weight, atol=0, rtol=0)
        torch.testing.assert_close(stacked.w2_weight, per_expert.w2_weight, atol=0, rtol=0)
    with pytest.raises(ModelLoadError, match="Shape mismatch"):
        stacked.load_stacked(stacked.w2_weight, CheckpointTensor.of("mlp.experts.down_proj", down[:, :, :-1]))
