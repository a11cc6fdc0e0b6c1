"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm) with
routed experts, no shared expert; `norm_topk_prob` says whether the top-k weights are
renormalised."""

from __future__ import annotations

from radixserve.models.moe_decoder import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True
