"""Llama-family decoder (Llama 2/3, SmolLM2), also the base of Qwen2 (qkv bias) and Qwen3 (q/k norm).

Projections are fused (qkv, gate_up) so each layer runs 4 GEMMs instead of 7; `load_weights`
maps HF checkpoint names onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.activation import silu_and_mul
from radixserve.layers.attention.radix_attention import RadixAttention
from radixserve.layers.linear import Linear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding, rope_config
from radixserve.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch

# HF name fragment -> (fused parameter fragment, shard id)
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, qkv_bias: bool, qk_norm: bool, max_position: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        theta, scaling = rope_config(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position, theta, scaling)
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, forward_batch)  # [num_tokens, q_size]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, qkv_bias: bool, qk_norm: bool, max_position: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, qk_norm, max_position)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, qk_norm, max_position)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        max_position = max(max_position or 0, config.max_position_embeddings)
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, qkv_bias, self.qk_norm, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Returns final hidden states [num_tokens, hidden_size]; LogitsProcessor projects them."""
        return self.model(input_ids, positions, forward_batch)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight  # [vocab_size, hidden_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # tied: the embedding is the head
            target, shard = _fused_target(name)
            if target not in params:
                raise ModelLoadError(
                    f"Checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}"
                )
            self._load_one(params[target], target, shard, tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded - ({"lm_head.weight"} if self.tie_word_embeddings else set()))
        if missing:
            raise ModelLoadError(f"Checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")

    def _load_one(
        self, param: nn.Parameter, name: str, shard: str | int | None, tensor: torch.Tensor
    ) -> None:
        dst = param.data
        if shard is not None:
            dst = _shard_view(dst, shard, self.model.layers[0].self_attn, name)
        if dst.shape != tensor.shape:
            raise ModelLoadError(
                f"Shape mismatch for {name}{f' ({shard})' if shard is not None else ''}: "
                f"the config implies {tuple(dst.shape)}, the checkpoint has {tuple(tensor.shape)}"
            )
        dst.copy_(tensor.to(dst.dtype))


def _fused_target(name: str) -> tuple[str, str | int | None]:
    for hf_frag, fused_frag, shard in STACKED_PARAMS:
        if hf_frag in name:
            return name.replace(hf_frag, fused_frag), shard
    return name, None


def _shard_view(fused: torch.Tensor, shard: str | int, attn: LlamaAttention, name: str) -> torch.Tensor:
    """The rows of a fused weight (or bias) that one HF projection fills."""
    if ".qkv_proj." in name:
        q, kv = attn.q_size, attn.kv_size
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
    else:
        half = fused.shape[0] // 2
        start, size = int(shard) * half, half
    return fused.narrow(0, start, size)
