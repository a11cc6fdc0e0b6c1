"""What the Qwen-VL families (Qwen2.5-VL, Qwen3-VL) share around their language model: M-RoPE on
every attention layer, the image rows of a prefill (encoding each image once, through the
embedding cache), and the checkpoint names of both save formats.

A model keeps its tower as `visual` (the checkpoint's names), `mm_cache` (set by the ModelRunner,
--mm-cache-size-mb) and `num_encoder_runs` (tests count it); `ImageRows` reads them through the
model passed in, so each model stays the decoder class it extends (Qwen2, Qwen3, Qwen3-MoE).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.mrope import MRotaryEmbedding
from radixserve.layers.rotary import rope_config
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.weights import CheckpointTensor

if TYPE_CHECKING:
    from radixserve.multimodal.embedding_cache import EmbeddingCache
    from radixserve.multimodal.inputs import MultimodalDataItem, MultimodalForward

# Checkpoint name prefixes: the original releases' and transformers 5's own save format.
VISUAL_PREFIXES = ("visual.", "model.visual.")
LM_PREFIX = "model.language_model."


def text_config_of(config: Any) -> Any:  # noqa: ANN401 - an HF config
    """The text config the decoder stack reads (a copy: the shared config stays as read), with the
    top level's tying."""
    text = copy.copy(config.get_text_config())
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def install_mrope(layers: Iterable[nn.Module], text: Any, interleaved: bool) -> None:  # noqa: ANN401
    """Swap each decoder layer's rotary embedding for M-RoPE with the config's mrope_section."""
    section = (text.rope_parameters or {}).get("mrope_section")
    if section is None:
        raise ModelLoadError("The text config has no rope_parameters.mrope_section (M-RoPE)")
    theta, _ = rope_config(text)
    for layer in layers:
        attn = layer.self_attn
        attn.rotary_emb = MRotaryEmbedding(
            attn.head_dim, attn.rotary_emb.cos_cached.shape[0], theta, section, interleaved
        )


def encode_item(
    item: MultimodalDataItem,
    tower: Callable[[torch.Tensor, tuple[int, int, int]], torch.Tensor],
    cache: EmbeddingCache | None,
) -> tuple[torch.Tensor, bool]:
    """(one image's encoder output [num_tokens, width], whether the tower ran): the cached output,
    else the tower's (then cached)."""
    embedding = cache.get(item.image_hash) if cache is not None else None
    if embedding is not None:
        return embedding, False
    embedding = tower(item.pixel_values, item.grid_thw)
    if cache is not None:
        cache.put(item.image_hash, embedding)
    return embedding, True


def image_rows(model: Any, mm: MultimodalForward, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN401
    """(batch rows [k] int64, their encoder outputs [k, width]) of the image tokens a prefill
    computes, encoding each image not encoded yet; a chunk gets the rows of its own tokens only.
    `model` has `visual`, `mm_cache` and `num_encoder_runs`."""
    rows, values = [], []
    for s in mm.slices:
        embedding = s.item.embedding
        if embedding is None:
            embedding, ran = encode_item(s.item, model.visual, model.mm_cache)
            model.num_encoder_runs += int(ran)
            s.item.embedding = embedding  # later chunks of the prompt read it (maybe_clear_mm_inputs)
        rows.append(torch.arange(s.row_start, s.row_start + s.token_end - s.token_start))
        values.append(embedding[s.token_start : s.token_end])
    return torch.cat(rows).to(device), torch.cat(values)


def lm_names(
    weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]],
) -> Iterable[tuple[str, torch.Tensor | CheckpointTensor]]:
    """Checkpoint names in the original releases' form (transformers 5 saves the language model
    under model.language_model.)."""
    for name, value in weights:
        if name.startswith(LM_PREFIX):
            name = "model." + name[len(LM_PREFIX) :]
        yield name, value


def visual_name(name: str) -> str | None:
    """The tower parameter a checkpoint name loads into (None: not the tower's). The patch
    embedding's Conv3d is our linear map `patch_embed`."""
    for prefix in VISUAL_PREFIXES:
        if name.startswith(prefix):
            sub = name[len(prefix) :]
            return (
                sub.replace("patch_embed.proj.", "patch_embed.", 1)
                if sub.startswith("patch_embed.proj.")
                else sub
            )
    return None


def load_visual(param: nn.Parameter, name: str, tensor: CheckpointTensor) -> None:
    """Copy a tower tensor (replicated on every rank) into `param`, the Conv3d kernel flattened
    to the linear map's rows."""
    data = tensor.full()
    if name == "visual.patch_embed.weight":
        data = data.reshape(data.shape[0], -1)
    if tuple(param.shape) != tuple(data.shape):
        raise ModelLoadError(
            f"Shape mismatch for {name}: the config implies {tuple(param.shape)}, the checkpoint "
            f"has {tuple(data.shape)}"
        )
    param.data.copy_(data.to(param.dtype))
