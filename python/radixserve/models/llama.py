"""Llama-family decoder (Llama 2/3, SmolLM2), also the base of Qwen2 (qkv bias) and Qwen3 (q/k norm).

Projections are fused (qkv, gate_up) so each layer runs 4 GEMMs instead of 7; `load_weights`
maps HF checkpoint names onto the fused parameters. Under tensor parallelism every projection,
the embedding and the LM head hold this rank's shard (layers/parallel_linear.py,
layers/vocab_parallel.py); under pipeline parallelism the model holds only its stage's layers (the
embedding on the first stage, the final norm and the LM head on the last), and the hidden states
cross stage boundaries as PPProxyTensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.distributed.communication import TensorParallelComm
from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.attention.radix_attention import RadixAttention
from radixserve.layers.norm import RMSNorm
from radixserve.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.rotary import RotaryEmbedding, rope_config
from radixserve.layers.vocab_parallel import VocabParallelEmbedding
from radixserve.model_executor.forward_batch import PPProxyTensors, StepYielded
from radixserve.model_loader.errors import ModelLoadError, copy_checked
from radixserve.model_loader.weights import CheckpointTensor
from radixserve.models.vlm_common import lm_name, load_visual, visual_name

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
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_TOP_LEVEL_PREFIXES = ("model.", "lm_head.", "score.")


@dataclass(frozen=True)
class DecoderSpec:
    """What the decoder's layers are built from, passed down unchanged from the model to each
    layer's attention: the HF config, the architecture's attention options, the longest position
    (rotary table) and this rank's place in the TP/PP layout."""

    config: Any
    qkv_bias: bool
    qk_norm: bool
    max_position: int
    parallel: ModelParallelism


class LlamaAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        config, parallel = spec.config, spec.parallel
        tp = parallel.tp
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        heads = parallel.attention_heads(total_heads, total_kv_heads)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, spec.qkv_bias, tp, heads
        )
        # This rank's heads (all of them at tp_size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            getattr(config, "attention_bias", False),
            tp,
            input_slice=(heads.q_start * self.head_dim, self.q_size),  # the columns of this rank's heads
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        theta, scaling = rope_config(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, spec.max_position, theta, scaling)
        # layer_id indexes this rank's KV pool, which holds only this stage's layers.
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
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TensorParallelComm) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        config = spec.config
        self.self_attn = LlamaAttention(spec, layer_id)
        bias = getattr(config, "mlp_bias", False)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, bias, spec.parallel.tp)
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


class MissingLayer(nn.Identity):
    """The place of a decoder layer another pipeline stage holds (no parameters)."""


class LlamaModel(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        layer_cls: type[nn.Module] = LlamaDecoderLayer,  # MoE models swap in their layer (moe_decoder.py)
    ) -> None:
        super().__init__()
        config, parallel = spec.config, spec.parallel
        tp = parallel.tp
        self.start_layer, self.end_layer = parallel.stage_layers(config.num_hidden_layers)
        self.is_last_stage = parallel.is_last_stage
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            if parallel.is_first_stage
            else None
        )
        self.layers = nn.ModuleList(
            layer_cls(spec, i - self.start_layer)
            if self.start_layer <= i < self.end_layer
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if parallel.is_last_stage else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        if pp_proxy is None:
            assert self.embed_tokens is not None, "a later pipeline stage needs the previous stage's states"
            hidden, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden_size]
            if forward_batch.input_embeds is not None:
                hidden = forward_batch.input_embeds.apply(hidden)
        else:
            hidden, residual = pp_proxy.hidden, pp_proxy.residual
        capture = forward_batch.capture_aux_layers
        deepstack = forward_batch.deepstack_embeds
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers[self.start_layer : self.end_layer], start=self.start_layer):
            if forward_batch.should_yield is not None and forward_batch.should_yield():
                raise StepYielded(f"yielded before layer {i}")
            if capture and i in capture:  # EAGLE3: the residual stream entering layer i
                # (a copy: the compiled residual-add norm updates `residual` in place)
                aux.append(hidden.clone() if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, forward_batch)
            if deepstack is not None and i < deepstack.num_layers:
                # The layer's output is hidden + residual; adding to either adds to the sum.
                hidden = deepstack.add(i, hidden)
        if capture:
            if self.end_layer in capture:
                aux.append(hidden + residual)
            forward_batch.spec_hidden = torch.cat(aux, dim=-1)
        if not self.is_last_stage:
            return PPProxyTensors(hidden, residual)
        assert self.norm is not None
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # Embedding variants (--is-embedding) and classifiers build no LM head: their checkpoints
    # (Qwen3-Embedding, *ForSequenceClassification) ship none.
    has_lm_head = True
    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer
    # A vision tower `visual` beside the decoder (models/vlm_common.py); its checkpoint names are
    # read here, so each VL model stays the decoder class it extends.
    takes_images = False

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or ModelParallelism()
        max_position = max(max_position or 0, config.max_position_embeddings)
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        spec = DecoderSpec(config, qkv_bias, self.qk_norm, max_position, parallel)
        self.model = LlamaModel(spec, self.decoder_layer_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head: VocabParallelEmbedding | None
        if not parallel.is_last_stage or not self.has_lm_head:
            self.lm_head = None
        elif self.tie_word_embeddings and self.model.embed_tokens is not None:
            self.lm_head = self.model.embed_tokens
        else:  # untied, or tied but the embedding lives on the first stage: loaded from it
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel.tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        """Final hidden states [num_tokens, hidden_size] (LogitsProcessor projects them), or on a
        stage before the last, the states the next stage continues from."""
        return self.model(input_ids, positions, forward_batch, pp_proxy)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage holds the LM head")
        return self.lm_head.weight  # [vocab rows of this rank, hidden_size]

    # ------------------------------------------------------------------ loading
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]], require_all: bool = True
    ) -> None:
        """Copy this rank's part of each checkpoint tensor into its parameter; tensors of other
        pipeline stages are skipped without being read. `require_all=False` (weight updates) loads
        a subset of the weights."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, value in weights:
            name = lm_name(name) if self.takes_images else name
            if not name.startswith(_TOP_LEVEL_PREFIXES):
                name = "model." + name  # embedding checkpoints saved from the bare model (Qwen3-Embedding)
            targets = self.param_targets(name)
            if not targets:
                continue
            tensor = CheckpointTensor.of(name, value)
            shard = fused_target(name)[1]
            for t in targets:
                if t not in params:
                    raise ModelLoadError(
                        f"Checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}"
                    )
                self._load_one(params[t], t, shard, tensor)
                loaded.add(t)
        # A parameter on the meta device has no values to load: a MoE layer's experts that serve
        # from a GGUF file's quantized forms only (model_loader/gguf_experts.py).
        missing = sorted(n for n in set(params) - loaded if not params[n].is_meta)
        if missing and require_all:
            raise ModelLoadError(f"Checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")

    def param_targets(self, name: str) -> list[str]:
        """The parameters a checkpoint tensor `name` loads into on this rank ([] when it belongs
        to another pipeline stage or is not a weight, e.g. rotary inv_freq)."""
        sub = visual_name(name) if self.takes_images else None
        if sub is not None:
            return [f"visual.{sub}"]
        if "rotary_emb.inv_freq" in name or not self._on_this_stage(name):
            return []
        if self.tie_word_embeddings and name.startswith("lm_head."):
            return []  # tied: the embedding is the head
        target, _ = fused_target(name)
        if self.tie_word_embeddings and target == "model.embed_tokens.weight" and self.lm_head is not None:
            params = dict(self.named_parameters())
            return [t for t in (target, "lm_head.weight") if t in params]
        return [target]

    def _on_this_stage(self, name: str) -> bool:
        inner = self.model
        match = _LAYER_INDEX.match(name)
        if match is not None:
            return inner.start_layer <= int(match.group(1)) < inner.end_layer
        if name.startswith("model.embed_tokens."):
            return inner.embed_tokens is not None or (self.tie_word_embeddings and self.lm_head is not None)
        if name.startswith("model.norm."):
            return inner.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def _load_one(
        self, param: nn.Parameter, name: str, shard: str | int | None, tensor: CheckpointTensor
    ) -> None:
        if name.startswith("visual."):
            load_visual(param, name, tensor)
        else:
            load_param(self, param, name, shard, tensor)


def load_param(
    model: nn.Module, param: nn.Parameter, name: str, shard: str | int | None, tensor: CheckpointTensor
) -> None:
    """Copy `tensor` into `model`'s parameter `name`: this rank's part of it through its module's
    weight_loader (the parallel layers'), else the whole tensor."""
    loader = getattr(model.get_submodule(name.rpartition(".")[0]), "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard)
    else:
        copy_checked(param.data, tensor.full(), name)


def fused_target(name: str) -> tuple[str, str | int | None]:
    """The fused parameter a checkpoint name loads into, and its part of it (q/k/v or the
    gate_up index; None when the name is not fused)."""
    for hf_frag, fused_frag, shard in STACKED_PARAMS:
        if hf_frag in name:
            return name.replace(hf_frag, fused_frag), shard
    return name, None
