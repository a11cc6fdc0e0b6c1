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

from typing import Any

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.models.qwen2 import Qwen2ForCausalLM
from radixserve.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from radixserve.models.vlm_common import (
    add_vision,
    check_parallel,
    install_mrope,
    text_config_of,
    vl_forward,
)


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    takes_images = True

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        super().__init__(text_config_of(config), max_position, check_parallel(parallel, "Qwen2.5-VL"))
        install_mrope(self.model.layers, self.config, interleaved=False)
        add_vision(self, Qwen2_5_VisionTransformer(config.vision_config))

    forward = vl_forward
