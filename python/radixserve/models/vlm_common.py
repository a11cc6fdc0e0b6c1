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

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.mrope import MRotaryEmbedding
from radixserve.layers.rotary import rope_config
from radixserve.model_executor.forward_batch import DeepstackEmbeds, InputEmbeds, PPProxyTensors
from radixserve.model_loader.errors import ModelLoadError, copy_checked
from radixserve.model_loader.weights import CheckpointTensor
from radixserve.models.vit_dp import encode_sharded

if TYPE_CHECKING:
    from radixserve.distributed.communication import TensorParallelComm
    from radixserve.model_executor.forward_batch import ForwardBatch
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


def check_parallel(parallel: ModelParallelism | None, family: str) -> ModelParallelism:
    parallel = parallel or ModelParallelism()
    if parallel.pp_size > 1:
        raise ModelLoadError(f"{family} does not support pipeline parallelism yet")
    return parallel


def add_vision(model: nn.Module, visual: nn.Module) -> None:
    """What a Qwen-VL model adds to its language model (the ModelRunner sets the cache and the DP
    encoder after loading)."""
    model.visual = visual
    model.num_encoder_runs = 0  # images encoded so far (tests count them)
    model.mm_cache: EmbeddingCache | None = None  # --mm-cache-size-mb
    model.dp_encoder: TensorParallelComm | None = None  # --mm-enable-dp-encoder


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
    `model` has `visual`, `mm_cache`, `num_encoder_runs` and `dp_encoder` (the TP group that
    shares the encoding under --mm-enable-dp-encoder, else None)."""
    if model.dp_encoder is not None:
        encode_batch_sharded(model, [s.item for s in mm.slices if s.item.embedding is None])
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


def _prepare_images(model: Any, input_ids: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:  # noqa: ANN401
    """Put a prefill's image rows (embeddings, Qwen3-VL's deepstack features) on the batch;
    returns the ids with the pad values (past the vocabulary) clamped, their embeddings being
    replaced."""
    mm = forward_batch.multimodal
    if mm is None:
        return input_ids
    rows, values = image_rows(model, mm, input_ids.device)  # values [k, (1 + n) * hidden_size]
    hidden, num_deep = model.config.hidden_size, model.visual.num_deepstack
    forward_batch.input_embeds = InputEmbeds(rows, values[:, :hidden])
    if num_deep:
        forward_batch.deepstack_embeds = DeepstackEmbeds(
            rows, values[:, hidden:].reshape(-1, num_deep, hidden)
        )
    return input_ids.clamp(0, model.config.vocab_size - 1)


def vl_forward(
    model: Any,  # noqa: ANN401 - a Qwen-VL model
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    forward_batch: ForwardBatch,
    pp_proxy: PPProxyTensors | None = None,
) -> torch.Tensor | PPProxyTensors:
    """The Qwen-VL models' forward: the language model over the prompt with its image rows (and
    deepstack features) in place, with the M-RoPE positions of batches holding an image."""
    input_ids = _prepare_images(model, input_ids, forward_batch)
    mrope = forward_batch.mrope_positions
    return model.model(input_ids, mrope if mrope is not None else positions, forward_batch, pp_proxy)


def encode_batch_sharded(model: Any, items: list[MultimodalDataItem]) -> None:  # noqa: ANN401
    """Set the embedding of every item (an image without one yet): from the embedding cache, else
    encoded by the TP ranks, each its share (models/vit_dp.py), once per distinct image."""
    misses: dict[int, list[MultimodalDataItem]] = {}  # image hash -> the items showing it
    for item in items:
        if item.image_hash in misses:
            misses[item.image_hash].append(item)
            continue
        cached = model.mm_cache.get(item.image_hash) if model.mm_cache is not None else None
        if cached is not None:
            item.embedding = cached
        else:
            misses[item.image_hash] = [item]
    if not misses:
        return  # every rank sees the same batch and cache: none of them gathers
    firsts = [same[0] for same in misses.values()]
    images = [(i.pixel_values, i.grid_thw, i.num_tokens) for i in firsts]
    outputs, num_encoded = encode_sharded(images, model.visual, model.visual.output_width, model.dp_encoder)
    model.num_encoder_runs += num_encoded
    for same, embedding in zip(misses.values(), outputs):
        if model.mm_cache is not None:
            model.mm_cache.put(same[0].image_hash, embedding)
        for item in same:
            item.embedding = embedding


def lm_name(name: str) -> str:
    """A checkpoint name in the original releases' form (transformers 5 saves the language model
    under model.language_model.)."""
    return "model." + name[len(LM_PREFIX) :] if name.startswith(LM_PREFIX) else name


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
    copy_checked(param.data, data, name)
