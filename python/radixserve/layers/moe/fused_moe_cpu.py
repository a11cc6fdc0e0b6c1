"""The grouped MoE kernel (CPU fast path; correct on any device): the (token, expert) pairs are
sorted by expert, each expert with tokens runs once over all of them as two matmuls, and the
weighted results are added back to their tokens. Work is proportional to num_tokens x top_k; an
expert no token chose is never touched (its weights are not even read, which is what makes a MoE
cheap to decode on a CPU). Python loops over the experts that got tokens, never over tokens.

The matmuls go through layers/linear.py's `linear`, so small fp32 groups (decode) take sgl-kernel's
small-M kernel where it is built; bf16 and larger groups run F.linear. With weight-only quantized
experts (`wq`, layers/moe/quantized.py) a group of at most `wq_max_tokens` tokens (every group, for forms
with int8-activation panels: group_quant.wq_rows_bound) runs each of its expert's two projections
through linear_wq on the quantized integers instead (the rule a dense Linear follows); a larger group reads the fp32 weight, or, where FusedMoE dropped it (its tensors
are then on the meta device), linear_wq up to DROPPED_WQ_MAX_TOKENS tokens and beyond that the
projection dequantized into the scratch buffer."""

from __future__ import annotations

import torch

from radixserve.layers.activation import silu_and_mul
from radixserve.layers.cpu_crossovers import active as crossovers
from radixserve.layers.group_quant import GroupQuantWeight, linear_wq, wq_rows_bound
from radixserve.layers.linear import linear
from radixserve.layers.moe.int8_experts import ExpertsInt8
from radixserve.layers.moe.quantized import DequantScratch, ExpertsWq
from radixserve.layers.quantization import linear_w8a8

# Where the fp32 experts were dropped, groups of up to this many tokens still run linear_wq:
# dequantizing a projection first costs about a linear_wq pass over tens of tokens. From an ad-hoc
# timing on a shared machine, not a repository benchmark (docs/quantization.md, "MoE files: quantized experts").
DROPPED_WQ_MAX_TOKENS = 64


def _project(
    x: torch.Tensor, weight: torch.Tensor, form: GroupQuantWeight | None, scratch: DequantScratch | None
) -> torch.Tensor:
    if form is not None and x.shape[0] <= wq_rows_bound(form, crossovers().wq_max_tokens):
        return linear_wq(x, form)
    if weight.is_meta:  # the fp32 copy was dropped: the form is the weight
        assert form is not None
        if x.shape[0] <= DROPPED_WQ_MAX_TOKENS:
            return linear_wq(x, form)
        weight = form.dequantize() if scratch is None else scratch.dequantize(form)
    return linear(x, weight)


def fused_experts_grouped(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int | None = None,
    wq: ExpertsWq | None = None,
    scratch: DequantScratch | None = None,
    int8: ExpertsInt8 | None = None,
) -> torch.Tensor:
    """Same contract as fused_moe_native.fused_experts_native. Under expert parallelism
        (`expert_start` set) w13 / w2 hold only experts [expert_start, expert_start + w13.shape[0]) of
        the layer: pairs routed to other experts contribute nothing here (their ranks add them). `wq`:
    the local experts' quantized forms, whose dequantization must equal w13 / w2, or with w13 / w2 on
    the meta device (dropped), the only weights; `scratch` is where large groups dequantize then
    (None: into a new tensor each time).
    `int8`: the local experts' W8A8 forms (--quantization w8a8_int8), which every group runs."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)  # [num_tokens * top_k]
    flat_weights = topk_weights.reshape(-1)
    pair_token = None  # the token of each pair kept, when only this rank's experts' pairs are
    if expert_start is not None:
        flat_ids = flat_ids - expert_start  # local expert ids; out of [0, num_experts): elsewhere
        local = ((flat_ids >= 0) & (flat_ids < num_experts)).nonzero().flatten()
        flat_ids, flat_weights, pair_token = flat_ids[local], flat_weights[local], local // top_k
    order = torch.argsort(flat_ids, stable=True)  # pair slots grouped by expert
    # The token of each sorted pair.
    token_idx = order // top_k if pair_token is None else pair_token.index_select(0, order)
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [num_experts]
    sizes, ends = counts.tolist(), counts.cumsum(0).tolist()
    x = hidden.index_select(0, token_idx)  # [num_tokens * top_k, hidden_size]
    out = torch.empty_like(x)
    for e in torch.nonzero(counts).flatten().tolist():
        start, end = ends[e] - sizes[e], ends[e]
        if int8 is not None:
            act = silu_and_mul(linear_w8a8(x[start:end], int8.w13[e], int8.w13_scale[e]))  # [n_e, inter]
            out[start:end] = linear_w8a8(act, int8.w2[e], int8.w2_scale[e])
            continue
        w13_form, w2_form = (None, None) if wq is None else (wq.w13[e], wq.w2[e])
        act = silu_and_mul(_project(x[start:end], w13[e], w13_form, scratch))  # [n_e, inter]
        out[start:end] = _project(act, w2[e], w2_form, scratch)
    weights = flat_weights.index_select(0, order).to(out.dtype)
    out.mul_(weights.unsqueeze(1))
    return torch.zeros_like(hidden).index_add_(0, token_idx, out)
