"""sgl-kernel's moe_wq_a8_packed (a MoE layer's routed experts in one call on their stacked
int8-activation panels) against the grouped path it replaces for decode-sized batches
(layers/moe/fused_moe_cpu.py's fused_experts_grouped on the same forms: equal bit for bit) and
against the torch reference (each token's experts through linear_wq_a8_reference and
silu_and_mul_native); the stacked panels against pack_wq_a8 per expert; expert parallelism's
foreign ids; the batches and forms the one-call path leaves to the grouped path."""

from __future__ import annotations

import pytest
import torch
from test_linear_wq import _weight  # random group-quantized weights of every form
from test_linear_wq_a8_packed import PANEL_ISAS  # the panel kernel's paths built here

from radixserve.layers.activation import silu_and_mul_native
from radixserve.layers.group_quant import linear_wq_a8_reference
from radixserve.layers.moe import fused_moe_a8
from radixserve.layers.moe.fused_moe_cpu import fused_experts_grouped
from radixserve.layers.moe.quantized import ExpertsWq, mark_int8_activations
from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.moe_wq_a8_packed_available(),
    reason="no moe_wq_a8_packed (AVX2 panel kernel) in this build",
)

# (hidden, inter, w13 bits, w13 offsets, w2 bits, w2 offsets, group): Q4_0 / Q4_1 experts as
# Mixtral's tiny file has them, Q8_0, and groups of 64 with offsets on both sides.
FORMS = {
    "q4-sym-q4-offsets": (96, 64, 4, False, 4, True, 32),
    "q8": (160, 96, 8, False, 8, False, 32),
    "group64-offsets": (128, 128, 4, True, 8, True, 64),
}
NUM_EXPERTS, TOP_K = 5, 3


def _experts(form: str, seed: int = 0) -> ExpertsWq:
    hidden, inter, b13, o13, b2, o2, group = FORMS[form]
    w13 = tuple(_weight(2 * inter, hidden, b13, group, o13, seed=seed + e) for e in range(NUM_EXPERTS))
    w2 = tuple(_weight(hidden, inter, b2, group, o2, seed=seed + 100 + e) for e in range(NUM_EXPERTS))
    return ExpertsWq(w13, w2)


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TOP_K distinct experts per token, positive weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return torch.rand(tokens, TOP_K, generator=gen) + 0.1, ids


def _x(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=gen) * (torch.rand(tokens, 1, generator=gen) + 0.5)


def _grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, wq: ExpertsWq, start: int | None = None
):
    """The grouped path on the same forms, their fp32 weights dropped (meta) as FusedMoE has them."""
    n = len(wq.w13)
    w13 = torch.empty(n, *wq.w13[0].qweight.shape[:1], x.shape[1], device="meta")
    w2 = torch.empty(n, x.shape[1], wq.w2[0].in_features, device="meta")
    return fused_experts_grouped(x, w13, w2, weights, ids, start, wq)


def _reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, wq: ExpertsWq) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            act = silu_and_mul_native(linear_wq_a8_reference(x[t : t + 1], wq.w13[e]))
            out[t] += w * linear_wq_a8_reference(act, wq.w2[e])[0]
    return out


@pytest.mark.parametrize("isa", PANEL_ISAS)
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 16, 40])
def test_equals_the_grouped_path_and_the_reference(isa: str, form: str, tokens: int) -> None:
    wq = mark_int8_activations(_experts(form, seed=tokens), panels=True)
    assert wq.w13_panels is not None and wq.w2_panels is not None
    x = _x(tokens, FORMS[form][0], seed=tokens)
    weights, ids = _routing(tokens, seed=tokens)
    got = cpu_kernels.moe_wq_a8_packed(x, ids, weights, wq.w13_panels, wq.w2_panels, isa=isa)
    # The grouped path (per-expert linear_wq_a8 on the same panels, silu_and_mul, mul_, index_add_;
    # the best path built, whose bits every path gives).
    assert torch.equal(got, _grouped(x, weights, ids, wq))
    # The torch reference: its SiLU rounds differently, and an activation on an int8 rounding
    # boundary then moves by one step (~1/254 of its block's largest value): a few 1e-4 of the
    # output's scale. A wrong expert, weight or panel moves it by its whole size.
    ref = _reference(x, weights, ids, wq)
    assert torch.allclose(got, ref, rtol=0, atol=2e-3 * float(ref.abs().max())), float(
        (got - ref).abs().max()
    )


def test_expert_parallel_ids_outside_the_rank_are_skipped() -> None:
    """A rank holding experts 2..4 of a layer: ids below 2 belong to another rank."""
    layer = _experts("q4-sym-q4-offsets")
    local = mark_int8_activations(ExpertsWq(layer.w13[2:], layer.w2[2:]), panels=True)
    x = _x(4, 96, seed=3)
    weights, ids = _routing(4, seed=3)
    got = fused_moe_a8.experts_on_panels(x, weights, ids, 2, local)
    assert got is not None
    assert torch.equal(got, _grouped(x, weights, ids, local, start=2))
    # A token whose experts are all elsewhere gets nothing from this rank.
    none_here = cpu_kernels.moe_wq_a8_packed(
        x[:1], ids[:1] * 0 - 1, weights[:1], local.w13_panels, local.w2_panels
    )
    assert torch.equal(none_here, torch.zeros_like(none_here))


@pytest.mark.parametrize("form", list(FORMS))
def test_stacked_panels_are_each_experts_pack(form: str) -> None:
    wq = mark_int8_activations(_experts(form), panels=True)
    for stacked, forms in ((wq.w13_panels, wq.w13), (wq.w2_panels, wq.w2)):
        for e, f in enumerate(forms):
            alone = cpu_kernels.pack_wq_a8(f.qweight, f.scales, f.offsets, f.bits, f.group_size)
            assert torch.equal(stacked.q[e], alone.q) and torch.equal(stacked.scales[e], alone.scales)
            assert (alone.offsets is None) == (stacked.offsets is None)
            # The per-expert form reads the stacked copy (a view), not a second one.
            assert f.a8_packed.q.data_ptr() == stacked.q[e].data_ptr()
    assert sum(f.a8_packed.nbytes() for f in wq.w13) == wq.w13_panels.nbytes()


def test_batches_and_forms_left_to_the_grouped_path() -> None:
    marked = mark_int8_activations(_experts("q8"), panels=True)
    weights, ids = _routing(130, seed=1)
    x = _x(130, 160, seed=1)
    # A prefill-sized batch takes the one call too (every group reads the panels at any size).
    assert fused_moe_a8.experts_on_panels(x, weights, ids, None, marked) is not None
    assert fused_moe_a8.experts_on_panels(x[:0], weights[:0], ids[:0], None, marked) is None
    # No stacked panels (no --cpu-wq-int8-activations), or none at all.
    plain = mark_int8_activations(_experts("q8"), panels=False)
    assert plain.w13_panels is None and plain.w13[0].int8_activations
    assert fused_moe_a8.experts_on_panels(x[:1], weights[:1], ids[:1], None, plain) is None
    assert fused_moe_a8.experts_on_panels(x[:1], weights[:1], ids[:1], None, None) is None


def test_mixed_layouts_keep_per_expert_panels() -> None:
    """Experts whose forms differ (one with offsets) cannot stack: each keeps its own panels."""
    wq = _experts("q4-sym-q4-offsets")
    odd = _weight(128, 96, 4, 32, offsets=True, seed=9)  # w13 [2 * inter, hidden]
    mixed = mark_int8_activations(ExpertsWq((odd, *wq.w13[1:]), wq.w2), panels=True)
    assert mixed.w13_panels is None and all(f.a8_packed is not None for f in mixed.w13)


def test_refusals() -> None:
    wq = mark_int8_activations(_experts("q4-sym-q4-offsets"), panels=True)
    x = _x(2, 96, seed=0)
    weights, ids = _routing(2, seed=0)
    with pytest.raises(RuntimeError, match="topk_ids must be a contiguous int64"):
        cpu_kernels.moe_wq_a8_packed(x, ids.to(torch.int32), weights, wq.w13_panels, wq.w2_panels)
    with pytest.raises(RuntimeError, match="packed_q must be"):
        cpu_kernels.moe_wq_a8_packed(_x(2, 128, seed=0), ids, weights, wq.w13_panels, wq.w2_panels)
    with pytest.raises(RuntimeError, match="topk_weights must be"):
        cpu_kernels.moe_wq_a8_packed(x, ids, weights[:1], wq.w13_panels, wq.w2_panels)
    with pytest.raises(RuntimeError, match="ISA path 1 is not compiled"):  # no scalar panel kernel
        cpu_kernels.moe_wq_a8_packed(x, ids, weights, wq.w13_panels, wq.w2_panels, isa="scalar")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tokens", [7, 11, 13, 64])
def test_prefill_groups_on_any_thread_split_equal_the_grouped_path(threads: int, tokens: int) -> None:
    """A prefill's 5-16 rows an expert (7-13 tokens x top-3 over 5 experts; 64: ~38 rows) take the
    GEMM tiles in balanced tiles with the weight prefetch, the items cut over the threads by rows:
    none of that may move a bit against the grouped path (per-expert linear_wq_a8 on the same
    panels), whatever the thread count."""
    wq = mark_int8_activations(_experts("q4-sym-q4-offsets", seed=tokens), panels=True)
    x = _x(tokens, FORMS["q4-sym-q4-offsets"][0], seed=tokens)
    weights, ids = _routing(tokens, seed=tokens)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = cpu_kernels.moe_wq_a8_packed(x, ids, weights, wq.w13_panels, wq.w2_panels)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, _grouped(x, weights, ids, wq))
