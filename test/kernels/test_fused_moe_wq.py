"""The grouped MoE kernel with weight-only quantized experts (GGUF Q8_0 / Q4_0 / Q4_1 blocks made
by gguf-py's quantizer, unpacked by gguf_quant) against the torch-native reference on the
dequantized experts: random shapes, top-k 1 to 8, experts that get no tokens, groups above and
below WQ_MAX_TOKENS (quantized and fp32 in one call)."""

import numpy as np
import pytest
import torch

from radixserve.layers import group_quant
from radixserve.layers.cpu_crossovers import DEFAULTS
from radixserve.layers.moe import fused_moe_cpu
from radixserve.layers.moe.fused_moe_cpu import DROPPED_WQ_MAX_TOKENS, fused_experts_grouped
from radixserve.layers.moe.fused_moe_native import fused_experts_native
from radixserve.layers.moe.quantized import DequantScratch, ExpertsWq
from radixserve.layers.moe.topk import select_experts
from radixserve.model_loader.gguf_quant import decode_quantized

# The bounds the tests run with (the test suite sets --cpu-kernel-tuning off: the defaults).
WQ_MAX_TOKENS = DEFAULTS.wq_max_tokens

pytest.importorskip("gguf")


def _form(weight: torch.Tensor, kind: str) -> group_quant.GroupQuantWeight:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rows, cols = weight.shape
    raw = quantize(weight.numpy().astype(np.float32), GGMLQuantizationType[kind])
    return decode_quantized(raw, kind, rows, cols)


def _experts(num_experts: int, hidden: int, inter: int, kinds: tuple[str, str], seed: int) -> ExpertsWq:
    gen = torch.Generator().manual_seed(seed)
    w13 = [torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5 for _ in range(num_experts)]
    w2 = [torch.randn(hidden, inter, generator=gen) / inter**0.5 for _ in range(num_experts)]
    return ExpertsWq(tuple(_form(w, kinds[0]) for w in w13), tuple(_form(w, kinds[1]) for w in w2))


CASES = [
    # (num_tokens, num_experts, top_k, hidden, inter)
    (1, 16, 8, 64, 32),
    (3, 8, 2, 96, 64),
    (6, 32, 1, 64, 32),  # most experts get no token
    (40, 8, 2, 64, 32),  # groups of ~10 (fp32) and smaller ones (quantized) in one call
]
KINDS = [("Q8_0", "Q8_0"), ("Q4_0", "Q4_1"), ("Q4_1", "Q4_0")]


@pytest.mark.parametrize("kinds", KINDS, ids=["-".join(k) for k in KINDS])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}" for c in CASES])
def test_quantized_experts_match_native_on_their_dequantization(case, kinds, monkeypatch):
    num_tokens, num_experts, top_k, hidden, inter = case
    wq = _experts(num_experts, hidden, inter, kinds, seed=sum(case))
    w13, w2 = wq.dequantize()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen) * 2, top_k, True)
    calls: list[int] = []

    def spy(
        x: torch.Tensor, w: group_quant.GroupQuantWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        calls.append(x.shape[0])
        return group_quant.linear_wq(x, w, bias)

    monkeypatch.setattr(fused_moe_cpu, "linear_wq", spy)
    got = fused_experts_grouped(x, w13, w2, weights, ids, wq=wq)
    ref = fused_experts_native(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    # Every expert group of at most WQ_MAX_TOKENS tokens read its quantized form (two projections
    # each); experts without tokens were not touched.
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    small = [int(c) for c in counts if 0 < c <= WQ_MAX_TOKENS]
    assert sorted(calls) == sorted(small * 2)
    assert calls or num_tokens > WQ_MAX_TOKENS


def test_quantized_experts_under_expert_parallelism():
    # A rank holding experts [4, 8) of 8: its part equals the native reference restricted to them.
    wq = _experts(8, 64, 32, ("Q4_0", "Q8_0"), seed=3)
    w13, w2 = wq.dequantize()
    local = ExpertsWq(wq.w13[4:], wq.w2[4:])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen)
    weights, ids = select_experts(torch.randn(5, 8, generator=gen), 2, False)
    got = fused_experts_grouped(x, w13[4:], w2[4:], weights, ids, expert_start=4, wq=local)
    mask = ids >= 4
    ref = fused_experts_native(x, w13, w2, weights * mask, ids)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_mismatched_form_counts_are_refused():
    wq = _experts(2, 64, 32, ("Q8_0", "Q8_0"), seed=0)
    with pytest.raises(ValueError, match="gate/up forms"):
        ExpertsWq(wq.w13, wq.w2[:1])


@pytest.mark.parametrize("kinds", KINDS[:2], ids=["-".join(k) for k in KINDS[:2]])
def test_dropped_fp32_experts_read_only_their_forms(kinds, monkeypatch):
    # FusedMoE's layout once the fp32 experts are dropped: w13 / w2 on the meta device. Groups of
    # every size (1 to ~150 tokens: linear_wq, and the scratch dequantization above
    # DROPPED_WQ_MAX_TOKENS) must equal the native reference on the dequantized experts.
    num_tokens, num_experts, top_k, hidden, inter = 300, 4, 2, 64, 32
    wq = _experts(num_experts, hidden, inter, kinds, seed=7)
    w13, w2 = wq.dequantize()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    logits[:, 3] -= 100.0  # expert 3 gets no token
    logits[:5, 2] += 100.0  # expert 2 gets a small group
    logits[5:, 2] -= 100.0
    weights, ids = select_experts(logits, top_k, True)
    dequantized: list[int] = []
    scratch = DequantScratch()
    real = scratch.dequantize

    def spy(form: group_quant.GroupQuantWeight) -> torch.Tensor:
        dequantized.append(form.out_features)
        return real(form)

    monkeypatch.setattr(scratch, "dequantize", spy)
    meta13, meta2 = w13.to("meta"), w2.to("meta")
    got = fused_experts_grouped(x, meta13, meta2, weights, ids, wq=wq, scratch=scratch)
    ref = fused_experts_native(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    large = int((counts > DROPPED_WQ_MAX_TOKENS).sum())
    assert large >= 1 and 0 < int(counts[2]) <= DROPPED_WQ_MAX_TOKENS and int(counts[3]) == 0
    assert len(dequantized) == 2 * large  # only large groups dequantize, one projection at a time
    assert scratch.nbytes() == 2 * inter * hidden * 4  # the largest projection, once
