"""EAGLE and EAGLE3 draft heads for Llama-family targets, in the HF checkpoint formats SGLang loads
(`LlamaForCausalLMEagle`, `LlamaForCausalLMEagle3`). They only run as drafts
(speculative/eagle_draft.py): the target's embedding (and for EAGLE its LM head) is attached after
loading, and every forward takes, per row, a hidden state of the draft's width beside its token.

EAGLE (EAGLE-1/2): x = fc(concat(embed(token), hidden)) [2h -> h, with bias], then the decoder
  layers (layer 0 without its input norm); the output is the last layer's residual stream (no
  final norm) and the LM head is the target's. Checkpoint keys: fc.*, layers.N.* (an
  embed_tokens / lm_head in the checkpoint is ignored: SGLang replaces both by the target's).
EAGLE3: the target's hidden states of three layers, concatenated [3h_t], go through fc (3h_t -> h,
  bias only when config.bias) once, when they are stored (EagleDraft.project); the one decoder
  layer (`midlayer`) normalises the token's embedding (input_layernorm) and the hidden state
  (hidden_norm) separately and attends over their concatenation [2h] (its q/k/v take 2h inputs);
  its output goes through `norm` into its own LM head over a reduced draft vocabulary
  (config.draft_vocab_size) whose ids map to the target's through `d2t` (target = draft + d2t[draft]);
  the residual stream before `norm` is the hidden state the next draft step takes. Checkpoint
  keys: fc.*, midlayer.*, norm.weight, lm_head.weight, d2t (t2d is not needed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.linear import Linear
from radixserve.layers.norm import RMSNorm
from radixserve.layers.parallel_linear import QKVParallelLinear
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.weights import CheckpointTensor
from radixserve.models.llama import DecoderSpec, LlamaDecoderLayer, fused_target, load_param

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch


def _max_position(config: Any, max_position: int | None) -> int:  # noqa: ANN401
    return max(max_position or 0, getattr(config, "max_position_embeddings", 0) or 0, 1)


class _EagleBase(nn.Module):
    """What both heads share: the target's embedding attached after loading, and the loader."""

    embed_tokens: nn.Module | None
    lm_head: nn.Module | None
    uses_target_lm_head: bool

    def attach_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """The target's embedding (always, as in SGLang) and LM head (when the head has none)."""
        if getattr(self, "own_embedding", False) is False:
            self.embed_tokens = embed_tokens
        if self.uses_target_lm_head:
            self.lm_head = lm_head

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's captured hidden state as the draft's hidden input (EAGLE: as is)."""
        return target_hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, value in weights:
            name = name.removeprefix("model.")
            tensor = CheckpointTensor.of(name, value)
            if name == "d2t":
                self._load_d2t(tensor.full())
                continue
            if name == "t2d" or "rotary_emb.inv_freq" in name or self._from_target(name):
                continue
            target, shard = fused_target(name)
            if target not in params:
                raise ModelLoadError(
                    f"EAGLE checkpoint tensor {name!r} has no parameter in {type(self).__name__}"
                )
            load_param(self, params[target], target, shard, tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"EAGLE checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")

    def _from_target(self, name: str) -> bool:
        """A checkpoint tensor this head takes from the target instead (SGLang replaces them)."""
        if name.startswith("embed_tokens.") and not getattr(self, "own_embedding", False):
            return True
        return name.startswith("lm_head.") and self.uses_target_lm_head

    def _load_d2t(self, d2t: torch.Tensor) -> None:
        raise ModelLoadError(f"{type(self).__name__} takes no d2t table")


class LlamaForCausalLMEagle(_EagleBase):
    uses_target_lm_head = True

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        super().__init__()
        parallel = parallel or ModelParallelism()
        self.config = config
        h = config.hidden_size
        self.draft_vocab_size = config.vocab_size
        self.fc = Linear(2 * h, h, bias=True)
        pos = _max_position(config, max_position)
        bias = getattr(config, "attention_bias", False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(DecoderSpec(config, bias, False, pos, parallel), i)
            for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's layer 0 has no input norm
        self.embed_tokens = None
        self.lm_head = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the states the LM head reads, the states the next draft step takes): both the last
        layer's residual stream [num_tokens, h]."""
        assert self.embed_tokens is not None, "attach_target() first"
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, fb)
        out = x + residual
        return out, out


class _Eagle3MidLayer(nn.Module):
    """EAGLE3's decoder layer: attention over concat(input_layernorm(embeds), hidden_norm(hidden))."""

    def __init__(self, config: Any, max_position: int, parallel: ModelParallelism) -> None:  # noqa: ANN401
        super().__init__()
        h = config.hidden_size
        bias = getattr(config, "attention_bias", False)
        base = LlamaDecoderLayer(DecoderSpec(config, bias, False, max_position, parallel), 0)
        attn = base.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * h, attn.head_dim, attn.qkv_proj.total_heads, attn.qkv_proj.total_kv_heads, False, parallel.tp
        )
        self.self_attn, self.mlp = attn, base.mlp
        self.input_layernorm = base.input_layernorm
        self.post_attention_layernorm = base.post_attention_layernorm
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden.clone()  # the compiled residual-add norm writes the sum into it
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLMEagle3(_EagleBase):
    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        super().__init__()
        parallel = parallel or ModelParallelism()
        if config.num_hidden_layers != 1:
            raise ModelLoadError(
                f"EAGLE3 heads with one decoder layer (midlayer) are supported; this one has "
                f"{config.num_hidden_layers}"
            )
        self.config = config
        h = config.hidden_size
        target_h = getattr(config, "target_hidden_size", None) or h
        self.fc = Linear(3 * target_h, h, bias=bool(getattr(config, "bias", False)))
        self.midlayer = _Eagle3MidLayer(config, _max_position(config, max_position), parallel)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # SGLang: the target's embedding unless the widths differ; no draft_vocab_size means the
        # target's LM head (and vocabulary).
        self.own_embedding = target_h != h
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if self.own_embedding else None
        draft_vocab = getattr(config, "draft_vocab_size", None)
        self.uses_target_lm_head = draft_vocab is None
        self.draft_vocab_size = draft_vocab or config.vocab_size
        self.lm_head = None if self.uses_target_lm_head else Linear(h, self.draft_vocab_size, bias=False)
        # Draft id -> target id; identity until a checkpoint's d2t is loaded.
        self.register_buffer("hot_token_ids", torch.arange(self.draft_vocab_size), persistent=False)

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden.to(self.fc.weight.dtype))

    def _load_d2t(self, d2t: torch.Tensor) -> None:
        if tuple(d2t.shape) != (self.draft_vocab_size,):
            raise ModelLoadError(
                f"d2t has shape {tuple(d2t.shape)}; the draft vocabulary has {self.draft_vocab_size} tokens"
            )
        ids = d2t.to(torch.int64) + torch.arange(self.draft_vocab_size)
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ModelLoadError("d2t maps draft ids outside the target's vocabulary")
        self.hot_token_ids = ids.to(self.hot_token_ids.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed states for the LM head, the residual stream before `norm`: the next step's
        hidden input), [num_tokens, h] each. `hidden` is already of width h (project())."""
        assert self.embed_tokens is not None, "attach_target() first"
        embeds = self.embed_tokens(input_ids)
        x, residual = self.midlayer(positions, embeds, hidden.to(embeds.dtype), fb)
        to_logits, to_next = self.norm(x, residual)
        return to_logits, to_next
