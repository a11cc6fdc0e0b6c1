"""OLMoE: Llama attention whose q and k projections are RMS-normalised over their whole width
(all heads together, before the split into heads) and optionally clamped to +-clip_qkv; every MLP
is a MoE of `num_experts` experts of `intermediate_size`, renormalised if `norm_topk_prob`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.norm import RMSNorm
from radixserve.model_loader.errors import ModelLoadError
from radixserve.models.llama import LlamaAttention
from radixserve.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM, MoeSpec

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch


class OlmoeAttention(LlamaAttention):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        qkv_bias: bool,
        qk_norm: bool,
        max_position: int,
        parallel: ModelParallelism,
    ) -> None:
        if parallel.tp.size > 1:
            # The norms' statistics span every head, which a TP rank does not hold.
            raise ModelLoadError("OLMoE does not support --tp-size > 1 yet (its q/k norms span all heads)")
        super().__init__(config, layer_id, qkv_bias, False, max_position, parallel)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv: float | None = getattr(config, "clip_qkv", None)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())  # over the whole width
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, forward_batch)  # [num_tokens, q_size]
        return self.o_proj(out)


class OlmoeDecoderLayer(MoeDecoderLayer):
    attention_cls = OlmoeAttention

    @staticmethod
    def moe_spec(config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )

    @staticmethod
    def is_sparse(config: Any, layer: int) -> bool:
        return True


class OlmoeForCausalLM(MoeForCausalLM):
    decoder_layer_cls = OlmoeDecoderLayer
