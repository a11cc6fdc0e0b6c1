"""The pieces every MoE architecture shares: the sparse MLP block (router -> top-k -> FusedMoE,
plus an optional shared expert), the decoder layer that holds it, and checkpoint-name mapping.

Attention, norms, rotary, the layer loop, pipeline stages and loading are the Llama decoder's
(models/llama.py): a MoE architecture is a LlamaForCausalLM whose decoder layers put a
SparseMoeBlock where the dense MLP was (and keep a dense MLP on the layers its config says).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.distributed.communication import TensorParallelComm
from radixserve.layers.moe.expert_distribution import ExpertDistributionRecorder
from radixserve.layers.moe.layer import FusedMoE, expert_param_name
from radixserve.layers.moe.topk import select_experts
from radixserve.layers.norm import RMSNorm
from radixserve.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)


@dataclass(frozen=True)
class MoeSpec:
    """One architecture's MoE hyper-parameters, read from its HF config once."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    renormalize: bool  # top-k weights rescaled to sum to 1 (HF's norm_topk_prob)
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(gate(x))


class SparseMoeBlock(nn.Module):
    """x -> sum over the top-k experts of weight * expert(x) (+ the shared expert's output).

    Parameter names are HF's (`gate` is the router, `shared_expert`, `shared_expert_gate`), so the
    checkpoint's names load unchanged; the routed experts are one FusedMoE (`experts`)."""

    def __init__(
        self, hidden_size: int, spec: MoeSpec, tp: TensorParallelComm, layer_id: int = 0, ep_size: int = 1
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.layer_id, self.num_experts = layer_id, spec.num_experts  # the model's layer index
        # Set by --expert-distribution-recorder-mode or --enable-expert-distribution-metrics
        # (layers/moe/expert_distribution.py).
        self.expert_recorder: ExpertDistributionRecorder | None = None
        # Replicated on every TP rank: each routes every token the same way. A plain nn.Linear,
        # not layers/linear.py's Linear, so the weight forms given to decoder linears (int8 under
        # w8a8_int8, fp16 copies) never touch it: routing stays the checkpoint's, and it is tiny.
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = FusedMoE(spec.num_experts, hidden_size, spec.intermediate_size, tp, ep_size)
        self.shared_expert = (
            LlamaMLP(hidden_size, spec.shared_intermediate_size, False, tp)
            if spec.shared_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False) if self.shared_expert and spec.shared_expert_gate else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)  # [num_tokens, num_experts]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.expert_recorder is not None and self.expert_recorder.active:
            self.expert_recorder.on_select(self.layer_id, topk_ids)
        out = self.experts(hidden, topk_weights, topk_ids)  # [num_tokens, hidden_size]
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer (its forward is inherited) with a SparseMoeBlock as `mlp` on the layers
    `is_sparse` picks. Architectures set `attention_cls` and override `moe_spec` / `is_sparse`."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, spec: DecoderSpec, layer_id: int) -> None:
        nn.Module.__init__(self)  # LlamaDecoderLayer.__init__ would build a dense MLP to discard
        config, parallel = spec.config, spec.parallel
        self.self_attn = self.attention_cls(spec, layer_id)
        # layer_id indexes this stage's KV pool; the config's layer choice uses the global index.
        global_id = parallel.stage_layers(config.num_hidden_layers)[0] + layer_id
        self.mlp: nn.Module
        if self.is_sparse(config, global_id):
            moe = self.moe_spec(config)
            self.mlp = SparseMoeBlock(config.hidden_size, moe, parallel.tp, global_id, parallel.ep_size)
        else:
            bias = getattr(config, "mlp_bias", False)
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, bias, parallel.tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def moe_spec(config: Any) -> MoeSpec:
        """Qwen-MoE's config keys (Qwen2-MoE, Qwen3-MoE); OLMoE and Mixtral override."""
        return MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
            shared_expert_gate=True,
        )

    @staticmethod
    def is_sparse(config: Any, layer: int) -> bool:
        """Qwen-MoE's rule: every `decoder_sparse_step`-th layer is sparse unless `mlp_only_layers`
        lists it."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        mlp_only = getattr(config, "mlp_only_layers", None) or []
        return layer not in mlp_only and config.num_experts > 0 and (layer + 1) % step == 0


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family causal LM with MoE decoder layers; loads per-expert checkpoint tensors into
    the stacked FusedMoE weights."""

    decoder_layer_cls = MoeDecoderLayer
    # Checkpoint module names that differ from ours (Mixtral's `block_sparse_moe` is our `mlp`).
    renamed_modules: tuple[tuple[str, str], ...] = ()

    def param_targets(self, name: str) -> list[str]:
        for theirs, ours in self.renamed_modules:
            name = name.replace(theirs, ours)
        stacked = expert_param_name(name)
        if stacked is None:
            return super().param_targets(name)
        return [stacked] if self._on_this_stage(name) else []
