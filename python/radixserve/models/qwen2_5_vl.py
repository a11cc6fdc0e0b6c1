"""Qwen2.5-VL: the Qwen2 decoder with M-RoPE, reading images through its vision tower.

The language model is Qwen2's stack (models/llama.py) with each layer's rotary embedding swapped
for M-RoPE. A prefill whose rows reach an image's tokens (ForwardBatch.multimodal) runs the tower
once per image, keeps the output on the scheduler's item for the prompt's later chunks, and puts
the image's rows in place of the token embeddings the same way a request's input_embeds are
(InputEmbeds). Batches with an image request carry 3-D positions (ForwardBatch.mrope_positions);
text-only batches use the 1-D positions, equal on all three axes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.mrope import MRotaryEmbedding
from radixserve.layers.rotary import rope_config
from radixserve.model_executor.forward_batch import InputEmbeds, PPProxyTensors
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.weights import CheckpointTensor
from radixserve.models.qwen2 import Qwen2ForCausalLM
from radixserve.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch
    from radixserve.multimodal.embedding_cache import EmbeddingCache
    from radixserve.multimodal.inputs import MultimodalDataItem, MultimodalForward

# Checkpoint name prefixes: the original release's and transformers 5's own save format.
_VISUAL_PREFIXES = ("visual.", "model.visual.")
_LM_PREFIX = "model.language_model."


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    takes_images = True

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        parallel = parallel or ModelParallelism()
        if parallel.pp_size > 1:
            raise ModelLoadError("Qwen2.5-VL does not support pipeline parallelism yet")
        # Qwen2's stack reads the text config; tying is the top level's (a copy: the shared
        # config stays as read).
        text = copy.copy(config.get_text_config())
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(text, max_position, parallel)
        self.vl_config = config
        section = (text.rope_parameters or {}).get("mrope_section")
        if section is None:
            raise ModelLoadError("Qwen2.5-VL's text config has no rope_parameters.mrope_section")
        theta, _ = rope_config(text)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.rotary_emb = MRotaryEmbedding(
                attn.head_dim, attn.rotary_emb.cos_cached.shape[0], theta, section
            )
        self.visual = Qwen2_5_VisionTransformer(config.vision_config)
        self.num_encoder_runs = 0  # images encoded so far (tests count them)
        self.mm_cache: EmbeddingCache | None = None  # set by the ModelRunner (--mm-cache-size-mb)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        if forward_batch.multimodal is not None:
            forward_batch.input_embeds = self._image_embeds(forward_batch.multimodal, input_ids.device)
            # Image rows hold pad values past the vocabulary; their embeddings are replaced.
            input_ids = input_ids.clamp(0, self.config.vocab_size - 1)
        if forward_batch.mrope_positions is not None:
            positions = forward_batch.mrope_positions  # [3, num_tokens]
        return self.model(input_ids, positions, forward_batch, pp_proxy)

    def _image_embeds(self, mm: MultimodalForward, device: torch.device) -> InputEmbeds:
        """The batch rows that read image embeddings, encoding each image not encoded yet."""
        rows, values = [], []
        for s in mm.slices:
            embedding = s.item.embedding
            if embedding is None:
                embedding = s.item.embedding = self._encode(s.item)
            rows.append(torch.arange(s.row_start, s.row_start + s.token_end - s.token_start))
            values.append(embedding[s.token_start : s.token_end])
        return InputEmbeds(torch.cat(rows).to(device), torch.cat(values))

    def _encode(self, item: MultimodalDataItem) -> torch.Tensor:
        """[num_tokens, hidden] of one image: the cached output, else the tower's (then cached)."""
        cache = self.mm_cache
        embedding = cache.get(item.image_hash) if cache is not None else None
        if embedding is None:
            embedding = self.visual(item.pixel_values, item.grid_thw)
            self.num_encoder_runs += 1
            if cache is not None:
                cache.put(item.image_hash, embedding)
        return embedding

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]], require_all: bool = True
    ) -> None:
        """Qwen2's loader, over names in the original release's form (transformers 5 saves the
        language model under model.language_model.)."""

        def renamed() -> Iterable[tuple[str, torch.Tensor | CheckpointTensor]]:
            for name, value in weights:
                if name.startswith(_LM_PREFIX):
                    name = "model." + name[len(_LM_PREFIX) :]
                yield name, value

        super().load_weights(renamed(), require_all)

    def param_targets(self, name: str) -> list[str]:
        sub = _visual_name(name)
        return [f"visual.{sub}"] if sub is not None else super().param_targets(name)

    def _load_one(
        self, param: torch.nn.Parameter, name: str, shard: str | int | None, tensor: CheckpointTensor
    ) -> None:
        if not name.startswith("visual."):
            super()._load_one(param, name, shard, tensor)
            return
        data = tensor.full()
        if name == "visual.patch_embed.weight":
            data = data.reshape(data.shape[0], -1)  # the Conv3d kernel as the linear map's rows
        if tuple(param.shape) != tuple(data.shape):
            raise ModelLoadError(
                f"Shape mismatch for {name}: the config implies {tuple(param.shape)}, the checkpoint "
                f"has {tuple(data.shape)}"
            )
        param.data.copy_(data.to(param.dtype))


def _visual_name(name: str) -> str | None:
    """The tower's parameter a checkpoint name loads into (None: not the tower's)."""
    for prefix in _VISUAL_PREFIXES:
        if name.startswith(prefix):
            sub = name[len(prefix) :]
            return "patch_embed.weight" if sub == "patch_embed.proj.weight" else sub
    return None
