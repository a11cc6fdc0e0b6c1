"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) with routed experts
plus a shared expert scaled by sigmoid(shared_expert_gate(x)); `decoder_sparse_step` and
`mlp_only_layers` pick the layers that keep a dense MLP."""

from __future__ import annotations

from radixserve.models.moe_decoder import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    qkv_bias = True
