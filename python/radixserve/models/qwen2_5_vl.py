"""Qwen2.5-VL: the Qwen2 decoder with M-RoPE, reading images through its vision tower.

The language model is Qwen2's stack (models/llama.py) with each layer's rotary embedding swapped
for M-RoPE. A prefill whose rows reach an image's tokens (ForwardBatch.multimodal) runs the tower
once per image, keeps the output on the scheduler's item for the prompt's later chunks, and puts
the image's rows in place of the token embeddings the same way a request's input_embeds are
(InputEmbeds). Batches with an image request carry 3-D positions (ForwardBatch.mrope_positions);
text-only batches use the 1-D positions, equal on all three axes. models/vlm_common.py holds what
Qwen3-VL shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.model_executor.forward_batch import InputEmbeds, PPProxyTensors
from radixserve.model_loader.errors import ModelLoadError
from radixserve.models.qwen2 import Qwen2ForCausalLM
from radixserve.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from radixserve.models.vlm_common import (
    image_rows,
    install_mrope,
    text_config_of,
)

if TYPE_CHECKING:
    from radixserve.distributed.communication import TensorParallelComm
    from radixserve.model_executor.forward_batch import ForwardBatch
    from radixserve.multimodal.embedding_cache import EmbeddingCache


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    takes_images = True

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        parallel = parallel or ModelParallelism()
        if parallel.pp_size > 1:
            raise ModelLoadError("Qwen2.5-VL does not support pipeline parallelism yet")
        super().__init__(text_config_of(config), max_position, parallel)
        self.vl_config = config
        install_mrope(self.model.layers, self.config, interleaved=False)
        self.visual = Qwen2_5_VisionTransformer(config.vision_config)
        self.num_encoder_runs = 0  # images encoded so far (tests count them)
        self.mm_cache: EmbeddingCache | None = None  # set by the ModelRunner (--mm-cache-size-mb)
        self.dp_encoder: TensorParallelComm | None = None  # set by the ModelRunner (--mm-enable-dp-encoder)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        if forward_batch.multimodal is not None:
            forward_batch.input_embeds = InputEmbeds(
                *image_rows(self, forward_batch.multimodal, input_ids.device)
            )
            # Image rows hold pad values past the vocabulary; their embeddings are replaced.
            input_ids = input_ids.clamp(0, self.config.vocab_size - 1)
        if forward_batch.mrope_positions is not None:
            positions = forward_batch.mrope_positions  # [3, num_tokens]
        return self.model(input_ids, positions, forward_batch, pp_proxy)
