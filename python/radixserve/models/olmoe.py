"""OLMoE: Llama attention whose q and k projections are RMS-normalised over their whole width
(all heads together, before the split into heads; under TP the sum of squares is all-reduced) and
optionally clamped to +-clip_qkv; every MLP is a MoE of `num_experts` experts of
`intermediate_size`, renormalised if `norm_topk_prob`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.distributed.communication import TensorParallelComm
from radixserve.model_loader.errors import ModelLoadError, check_shape
from radixserve.model_loader.weights import CheckpointTensor
from radixserve.models.llama import DecoderSpec, LlamaAttention
from radixserve.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM, MoeSpec

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose columns are split across the TP ranks: each rank holds the
    columns [start, start + size) of a `total`-wide vector and of the norm's weight, and the sum of
    squares is all-reduced, so every rank scales by the whole vector's RMS. At tp_size 1 it is
    RMSNorm's reference arithmetic."""

    def __init__(self, total: int, start: int, size: int, eps: float, tp: TensorParallelComm) -> None:
        super().__init__()
        self.total, self.start, self.tp = total, start, tp
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # [num_tokens, size]
        sumsq = x32.pow(2).sum(-1, keepdim=True)  # [num_tokens, 1]
        self.tp.all_reduce_(sumsq)
        out = x32 * torch.rsqrt(sumsq / self.total + self.variance_epsilon)
        return out.to(x.dtype) * self.weight

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        check_shape(loaded.name, (self.total,), loaded.shape)
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))


class OlmoeAttention(LlamaAttention):
    def __init__(self, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__(dataclasses.replace(spec, qk_norm=False), layer_id)
        config, heads, d, tp = spec.config, self.qkv_proj.heads, self.head_dim, spec.parallel.tp
        total_kv = self.qkv_proj.total_kv_heads
        if tp.size > total_kv:
            # A replicated KV head would count its squares once per rank holding it.
            raise ModelLoadError(
                f"OLMoE with {total_kv} KV heads does not support --tp-size {tp.size} (at most {total_kv})"
            )
        eps = config.rms_norm_eps
        # The norms span all heads (before the split into heads): a rank normalises its heads'
        # columns by the whole projection's RMS.
        self.q_norm = ShardedRMSNorm(self.qkv_proj.total_heads * d, heads.q_start * d, self.q_size, eps, tp)
        self.k_norm = ShardedRMSNorm(total_kv * d, heads.kv_start * d, self.kv_size, eps, tp)
        self.clip_qkv: float | None = getattr(config, "clip_qkv", None)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)  # over the whole width, all ranks' heads
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
