"""Tiny random Qwen2.5-VL and Qwen3-VL (dense and MoE) checkpoints for tests: config, weights, a
tokenizer with the vision special tokens and the image processor's config, loadable by radixserve
and HF transformers (offline)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import torch

from radixserve.testing.tiny_models import _COMMON, TINY_VOCAB, write_tiny_tokenizer

# Special tokens first, so their ids are fixed: 0..6.
VLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 3, 4, 5, 6
TINY_VLM_VOCAB = TINY_VOCAB
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# ChatML whose content may be a list of parts, an image part rendered as the image placeholder
# where it stands (the shape of Qwen2.5-VL's own template).
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Patches of 14 px merged 2x2: a 56x84 image is a 4x6 patch grid, 6 tokens for the LM. The pixel
# limits keep test images small (at most 16 merged tokens).
_PROCESSOR = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16, "patch_size": 14, "merge_size": 2}

# The tiny text models' sizes; head_dim 16: 8 rotary pairs split over (temporal, height, width).
_TEXT = {
    **_COMMON,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}
_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    # 56 px windows: 2x2 merged units each, so a 4x6 grid has several windows (and a ragged one).
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "initializer_range": 0.25,
}


def write_vlm_tokenizer(path: Path) -> None:
    write_tiny_tokenizer(
        path, TINY_VLM_VOCAB, special_tokens=VLM_SPECIAL_TOKENS, chat_template=VLM_CHAT_TEMPLATE
    )


def _vl_config(config_cls: type, text: dict[str, Any], vision: dict[str, Any], tie: bool) -> Any:  # noqa: ANN401
    """An HF VL config with this module's special-token ids (the tiny models' and the benchmark's)."""
    config = config_cls(
        text_config=dict(text),
        vision_config=dict(vision),
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=tie,
    )
    config.architectures = [config_cls.__name__.removesuffix("Config") + "ForConditionalGeneration"]
    return config


def qwen2_5_vl_config(text: dict[str, Any], vision: dict[str, Any], tie_word_embeddings: bool) -> Any:  # noqa: ANN401
    from transformers import Qwen2_5_VLConfig

    return _vl_config(Qwen2_5_VLConfig, text, vision, tie_word_embeddings)


def _write_vlm(path: str | Path, model: Any, processor: dict[str, Any], randomize: Any) -> Path:  # noqa: ANN401
    """Save `model` with its weights redrawn by `randomize(name, param)`, the tokenizer, the image
    processor's config and a generation config to `path`. transformers' Qwen3VLProcessor would
    also build its video processor, which needs torchvision (not a dependency): the image
    processor alone is what radixserve reads."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for name, param in model.to(torch.float32).named_parameters():
            if name.endswith("norm.weight") or ".norm1." in name or ".norm2." in name or "ln_q" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif randomize(name):
                param.normal_(0.0, 0.25)
    model.save_pretrained(path, safe_serialization=True)
    write_vlm_tokenizer(path)
    Qwen2VLImageProcessorPil(**processor).save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path


def make_tiny_qwen2_5_vl(path: str | Path, seed: int = 0) -> Path:
    """Write a random tiny Qwen2_5_VLForConditionalGeneration to `path`."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config(_TEXT, _VISION, tie_word_embeddings=False))
    return _write_vlm(path, model, _PROCESSOR, lambda name: "visual" in name)


# Qwen3-VL: 16 px patches merged 2x2 (the processor resizes to multiples of 32 px), a 4x4 learned
# position grid (resampled up and down to each image's grid), deepstack from blocks 0 and 1 into
# language-model layers 0 and 1 of 3 (layer 2 has none).
_QWEN3_PROCESSOR = {
    "min_pixels": 32 * 32,
    "max_pixels": 32 * 32 * 16,
    "patch_size": 16,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
_QWEN3_TEXT = {
    **_TEXT,
    "num_hidden_layers": 3,
    "head_dim": 16,
    # 8 rotary pairs interleaved t, h, w: height takes pairs 1, 4, 7; width 2, 5; time 0, 3, 6.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
}
_QWEN3_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,  # the stacked expert tensors are not square: their layout is checked
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],  # one dense layer among the sparse ones
}
_QWEN3_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 1],
    "hidden_act": "gelu_pytorch_tanh",
    "initializer_range": 0.25,
}


def make_tiny_qwen3_vl(path: str | Path, moe: bool = False, seed: int = 0) -> Path:
    """Write a random tiny Qwen3VLForConditionalGeneration (Qwen3VLMoeForConditionalGeneration
    with `moe`) to `path`."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    text = {**_QWEN3_TEXT, **(_QWEN3_MOE if moe else {})}
    config = _vl_config(Qwen3VLMoeConfig if moe else Qwen3VLConfig, text, _QWEN3_VISION, tie=False)
    torch.manual_seed(seed)
    model = (Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration)(config)

    def randomize(name: str) -> bool:
        return "visual" in name or "experts" in name or name.endswith("mlp.gate.weight")

    return _write_vlm(path, model, _QWEN3_PROCESSOR, randomize)


def random_image(width: int, height: int, seed: int) -> Any:  # noqa: ANN401 - a PIL image
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_data_url(image: Any) -> str:  # noqa: ANN401 - a PIL image
    """`image` as a PNG data: URL, one form /generate's image_data takes."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def hf_vlm_greedy(
    model: Any, ids: list[int], pixel_values: Any, grid_thw: Any, max_new_tokens: int
) -> list[int]:  # noqa: ANN401
    """HF transformers' greedy tokens for a prompt whose image tokens are already expanded: one
    prefill with the images, then one step per token over HF's KV cache (EOS is a token like any
    other, as with ignore_eos; a generated image-pad id is a plain token too)."""
    from transformers import DynamicCache

    kwargs: dict[str, Any] = {}
    if pixel_values is not None:
        # The processor's mm_token_type_ids (1 at image tokens) switch on HF's M-RoPE positions.
        types = torch.tensor([[int(t == IMAGE_TOKEN_ID) for t in ids]], dtype=torch.int32)
        kwargs = {"pixel_values": pixel_values, "image_grid_thw": grid_thw, "mm_token_type_ids": types}
    cache = DynamicCache(config=model.config)
    model.model.rope_deltas = None  # HF keeps the last prompt's delta on the model: not this one's
    out: list[int] = []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, **kwargs).logits
        for step in range(max_new_tokens):
            out.append(int(logits[0, -1].argmax()))
            if step + 1 < max_new_tokens:
                logits = model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits
    return out
