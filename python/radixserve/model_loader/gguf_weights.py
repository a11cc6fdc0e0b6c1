"""--quantization gguf: each decoder linear and the LM head get the GGUF file's own quantized
tensors as their weight-only form (Linear.weight_wq), and a MoE layer's experts theirs
(model_loader/gguf_experts.py). The shared expert of Qwen2-MoE is a dense MLP like any other.

The fp32 weights load from the file's conversion as without the flag (they are the file
dequantized), so a layer's wq form and its fp32 weight hold the same values, and the fp32 one
serves the batches the wq kernel does not (layers/linear.py). The routed experts are the exception:
the conversion leaves them out and the loader attaches their forms straight from the file
(gguf_experts.py), so they never exist in fp32. Each form is this rank's part of
the file's tensors, cut exactly as the fp32 loaders cut theirs (layers/parallel_linear.py,
layers/vocab_parallel.py): column-parallel layers take their rows (q/k/v by heads), row-parallel
ones their inputs (whole quantization groups only), the LM head its vocabulary block.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from radixserve.layers.group_quant import GroupQuantWeight
from radixserve.layers.group_quant_ops import concat_rows, pad_rows, take_inputs, take_rows
from radixserve.layers.linear import Linear
from radixserve.layers.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.vocab_parallel import VocabParallelEmbedding
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_arch import resolve_arch
from radixserve.model_loader.gguf_convert import read_metadata, undo_rope_permute
from radixserve.model_loader.gguf_experts import ExpertForm, experts_form
from radixserve.model_loader.gguf_quant import check_tensor_types, tensor_group_quant

logger = logging.getLogger(__name__)

# The fused linears of a decoder layer: attribute path -> the GGUF tensors they concatenate.
_ATTENTION_LINEARS = (
    ("self_attn.qkv_proj", ("attn_q", "attn_k", "attn_v")),
    ("self_attn.o_proj", ("attn_output",)),
)
_DENSE_MLP_LINEARS = (
    ("mlp.gate_up_proj", ("ffn_gate", "ffn_up")),
    ("mlp.down_proj", ("ffn_down",)),
)
_SHARED_EXPERT_LINEARS = (
    ("mlp.shared_expert.gate_up_proj", ("ffn_gate_shexp", "ffn_up_shexp")),
    ("mlp.shared_expert.down_proj", ("ffn_down_shexp",)),
)

Form = tuple[str, Linear, GroupQuantWeight]
EmbeddingForm = tuple[str, VocabParallelEmbedding, GroupQuantWeight]  # as weight_only_forms.py's


class _Tensors:
    """The file's tensors by name, decoded once each."""

    def __init__(self, path: str) -> None:
        from gguf import GGUFReader

        try:
            reader = GGUFReader(path)
        except Exception as exc:  # GGUFReader raises ValueError/struct errors on a bad file
            raise ModelLoadError(f"Cannot read GGUF file {path}: {exc}") from exc
        check_tensor_types(list(reader.tensors))
        self.path = path
        # llama.cpp interleaved Q/K rows for llama-style rope only (not Qwen's NEOX rope).
        self.rope_permuted = resolve_arch(read_metadata(reader)).rope_permuted
        self.by_name = {t.name: t for t in reader.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def group_quant(self, name: str) -> GroupQuantWeight | None:
        if name not in self.by_name:
            raise ModelLoadError(f"GGUF file {self.path} has no tensor {name!r}")
        return tensor_group_quant(self.by_name[name])


def _rope_rows(w: GroupQuantWeight, num_heads: int) -> GroupQuantWeight:
    """Undo llama.cpp's Q/K row interleaving (the conversion undoes it on the fp32 rows alike)."""
    order = undo_rope_permute(np.arange(w.out_features)[:, None], num_heads)[:, 0]
    return take_rows(w, torch.from_numpy(np.ascontiguousarray(order)))


def _row_parts(layer: Linear) -> list[tuple[int, int]]:
    """(start, length) of the rows of each fused part this rank holds, in the layer's order."""
    if isinstance(layer, QKVParallelLinear):
        d, heads = layer.head_dim, layer.heads
        kv = (heads.kv_start * d, layer.kv_size)
        return [(heads.q_start * d, layer.q_size), kv, kv]
    if isinstance(layer, MergedColumnParallelLinear):
        return [(layer.tp.rank * size, size) for size in layer.local_sizes]
    tp = getattr(layer, "tp", None)
    if tp is not None and not isinstance(layer, RowParallelLinear):  # ColumnParallelLinear
        return [(tp.rank * layer.out_features, layer.out_features)]
    return [(0, layer.out_features)]


def _layer_form(
    tensors: _Tensors, layer: Linear, names: list[str], heads: dict[str, int]
) -> GroupQuantWeight | None:
    parts = []
    for name, (start, length) in zip(names, _row_parts(layer)):
        w = tensors.group_quant(name)
        if w is None:  # an F32/F16/BF16 tensor: the layer serves from fp32
            return None
        kind = name.split(".")[-2]
        if kind in heads and tensors.rope_permuted:
            w = _rope_rows(w, heads[kind])
        parts.append(take_rows(w, slice(start, start + length)))
    if len({(p.bits, p.group_size, p.offsets is None) for p in parts}) > 1:
        # e.g. Q4_K_M's Q4_K q/k with a Q6_K v: one fused form in the finest common layout.
        logger.debug(
            "%s: mixed GGUF types fused as %d-bit groups", ", ".join(names), max(p.bits for p in parts)
        )
    form = concat_rows(parts)
    if isinstance(layer, RowParallelLinear) and layer.input_size != layer.total_in_features:
        form = take_inputs(form, layer.input_start, layer.input_size, names[0])
    if (form.out_features, form.in_features) != tuple(layer.weight.shape):
        raise ModelLoadError(
            f"GGUF tensors {', '.join(names)} make a [{form.out_features}, {form.in_features}] weight; "
            f"the model's layer is {list(layer.weight.shape)}"
        )
    return form


def _lm_head_form(tensors: _Tensors, model: Any, head: Linear) -> GroupQuantWeight | None:
    name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    w = tensors.group_quant(name)
    if w is None:
        return None
    block = model.lm_head  # VocabParallelEmbedding: this rank's block of vocabulary rows
    rows = take_rows(w, slice(block.vocab_start, block.vocab_start + block.num_valid_rows))
    return pad_rows(rows, head.weight.shape[0])


def gguf_embedding_form(path: str, model: nn.Module) -> EmbeddingForm | None:
    """The token embedding's form (this rank's block of rows) where the file's token_embd is
    quantized and the model's embedding is its own (untied: a tied embedding's fp32 rows are the
    LM head's weight, which the head's batches read); else None."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not isinstance(embed, VocabParallelEmbedding) or getattr(model, "lm_head", None) is embed:
        return None
    if getattr(model, "tie_word_embeddings", False) or embed.weight.dtype != torch.float32:
        return None
    w = _Tensors(path).group_quant("token_embd.weight")
    if w is None:
        return None
    rows = take_rows(w, slice(embed.vocab_start, embed.vocab_start + embed.num_valid_rows))
    form = pad_rows(rows, embed.rows_per_rank)
    if (form.out_features, form.in_features) != tuple(embed.weight.shape):
        raise ModelLoadError(
            f"GGUF token_embd makes a [{form.out_features}, {form.in_features}] block; the model's "
            f"embedding is {list(embed.weight.shape)}"
        )
    return ("model.embed_tokens", embed, form)


def _block_linears(block: nn.Module) -> tuple[tuple[str, tuple[str, ...]], ...]:
    moe = getattr(block.mlp, "experts", None)
    if moe is None:
        return _ATTENTION_LINEARS + _DENSE_MLP_LINEARS
    return _ATTENTION_LINEARS + (_SHARED_EXPERT_LINEARS if block.mlp.shared_expert is not None else ())


def gguf_linear_forms(
    path: str, model: nn.Module, lm_head: nn.Module | None, fresh_experts: bool = False
) -> tuple[list[Form], list[ExpertForm]]:
    """(name, layer, form) for every decoder linear of this rank's stage and its LM head (the
    runner's Linear over the head weight) whose GGUF tensors are quantized; and (name, FusedMoE,
    forms) for every MoE layer's experts: those the loader attached, or with `fresh_experts` (a
    weight update from another file) read from `path`."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        raise ModelLoadError(
            f"--quantization gguf serves decoder-only language models, not {type(model).__name__}"
        )
    tensors = _Tensors(path)
    config = model.config
    num_heads = config.num_attention_heads
    heads = {"attn_q": num_heads, "attn_k": getattr(config, "num_key_value_heads", None) or num_heads}
    forms: list[Form] = []
    expert_forms: list[ExpertForm] = []
    plain: list[str] = []
    for i in range(inner.start_layer, inner.end_layer):
        block = inner.layers[i]
        for attr, kinds in _block_linears(block):
            layer = block.get_submodule(attr)
            form = _layer_form(tensors, layer, [f"blk.{i}.{k}.weight" for k in kinds], heads)
            name = f"model.layers.{i}.{attr}"
            (plain.append(name) if form is None else forms.append((name, layer, form)))
        moe = getattr(block.mlp, "experts", None)
        if moe is not None:
            name = f"model.layers.{i}.mlp.experts"
            # Attached by the loader, which built the layer without fp32 experts (gguf_experts.py);
            # else (a conversion of the old layout, with fp32 experts) made here and checked.
            form = (
                moe.experts_wq
                if moe.experts_wq is not None and not fresh_experts
                else experts_form(tensors.path, tensors.by_name, i, moe)
            )
            (plain.append(name) if form is None else expert_forms.append((name, moe, form)))
    if lm_head is not None:
        head = getattr(lm_head, "local_head", lm_head)  # GatheredLMHead under TP
        form = _lm_head_form(tensors, model, head)
        (plain.append("lm_head") if form is None else forms.append(("lm_head", head, form)))
    if plain:
        logger.info(
            "--quantization gguf: %d linears or expert sets have float tensors in the file and serve in fp32",
            len(plain),
        )
    return forms, expert_forms
