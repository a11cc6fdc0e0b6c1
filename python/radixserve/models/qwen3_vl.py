"""Qwen3-VL (dense: the Qwen3 decoder, q/k norm) and Qwen3-VL-MoE (the Qwen3-MoE decoder), reading
images through models/qwen3_vl_vision.py.

What differs from Qwen2.5-VL (models/qwen2_5_vl.py, whose request side, pad values, embedding
cache and encoder-in-prefill this reuses through models/vlm_common.py):
- M-RoPE is interleaved: the rotary pairs take time, height, width in turn (layers/mrope.py);
- deepstack: the tower also returns features of some of its blocks, one per language-model layer
  0..n-1, added to those layers' output states at the image-token rows. The tower's output is one
  tensor per image, main embedding then deepstack features side by side, so the embedding cache
  keeps them together and a prefill chunk that cuts through an image reads the rows of its own
  tokens of both (ForwardBatch.deepstack_embeds).

The two classes extend different decoders; what they share is the module-level functions here.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.weights import CheckpointTensor
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.moe_decoder import MoeDecoderLayer, MoeSpec
from radixserve.models.qwen3 import Qwen3ForCausalLM
from radixserve.models.qwen3_moe import Qwen3MoeForCausalLM
from radixserve.models.qwen3_vl_vision import Qwen3VisionTransformer
from radixserve.models.vlm_common import (
    add_vision,
    check_parallel,
    install_mrope,
    text_config_of,
    vl_forward,
)

# Qwen3-VL-MoE stores each layer's experts as two stacked tensors, not one tensor per expert.
_STACKED_EXPERTS = (
    (".mlp.experts.gate_up_proj", ".mlp.experts.w13_weight"),
    (".mlp.experts.down_proj", ".mlp.experts.w2_weight"),
)


def _build_vision(model: LlamaForCausalLM, config: Any) -> Qwen3VisionTransformer:  # noqa: ANN401
    """Interleaved M-RoPE on every layer, and the tower."""
    if (model.config.rope_parameters or {}).get("mrope_interleaved") is False:
        # transformers' Qwen3-VL always interleaves: a config saying otherwise is not Qwen3-VL's.
        raise ModelLoadError("Qwen3-VL's M-RoPE is interleaved, but the config sets mrope_interleaved: false")
    install_mrope(model.model.layers, model.config, interleaved=True)
    visual = Qwen3VisionTransformer(config.vision_config)
    if visual.num_deepstack > model.config.num_hidden_layers:
        raise ModelLoadError(
            f"{visual.num_deepstack} deepstack features for a {model.config.num_hidden_layers}-layer model"
        )
    return visual


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    takes_images = True

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        super().__init__(text_config_of(config), max_position, check_parallel(parallel, "Qwen3-VL"))
        add_vision(self, _build_vision(self, config))

    forward = vl_forward


class Qwen3VLMoeDecoderLayer(MoeDecoderLayer):
    @staticmethod
    def moe_spec(config: Any) -> MoeSpec:  # noqa: ANN401
        # transformers' Qwen3-VL-MoE router always renormalises the top-k weights (its config has
        # no norm_topk_prob) and has no shared expert.
        return MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=True,
        )


class Qwen3VLMoeForConditionalGeneration(Qwen3MoeForCausalLM):
    takes_images = True
    decoder_layer_cls = Qwen3VLMoeDecoderLayer

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        super().__init__(text_config_of(config), max_position, check_parallel(parallel, "Qwen3-VL"))
        add_vision(self, _build_vision(self, config))

    forward = vl_forward

    def param_targets(self, name: str) -> list[str]:
        for theirs, ours in _STACKED_EXPERTS:
            if name.endswith(theirs):
                return [name[: -len(theirs)] + ours] if self._on_this_stage(name) else []
        return super().param_targets(name)

    def _load_one(
        self, param: torch.nn.Parameter, name: str, shard: str | int | None, tensor: CheckpointTensor
    ) -> None:
        if name.endswith(tuple(ours for _, ours in _STACKED_EXPERTS)):
            self.get_submodule(name.rpartition(".")[0]).load_stacked(param, tensor)
        else:
            super()._load_one(param, name, shard, tensor)
