"""--quantization gguf on a MoE file: each FusedMoE's local experts get the file's stacked
`blk.N.ffn_{gate,up,down}_exps.weight` tensors (torch order [num_experts, rows, cols]) as their
weight-only forms (layers/moe/quantized.py), cut exactly as FusedMoE's fp32 loader cuts the
per-expert tensors: this rank's experts (--ep-size), and of each its slice of the intermediate
dimension (gate/up rows, down inputs: whole quantization groups only)."""

from __future__ import annotations

from typing import Any

import numpy as np

from radixserve.layers.group_quant import GroupQuantWeight
from radixserve.layers.group_quant_ops import concat_rows, take_inputs, take_rows
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.quantized import ExpertsWq
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_quant import GGUF_PLAIN_TYPES, decode_quantized

ExpertForm = tuple[str, FusedMoE, ExpertsWq]


def stacked_group_quant(tensor: Any) -> tuple[GroupQuantWeight, int] | None:
    """A 3-D GGUF expert tensor as one GroupQuantWeight [num_experts * rows, cols] and `rows` (one
    expert's), or None for the plain types (those experts serve in fp32)."""
    kind = tensor.tensor_type.name
    if kind in GGUF_PLAIN_TYPES:
        return None
    cols, rows, num_experts = (int(d) for d in tensor.shape.tolist())  # fastest dimension first
    raw = np.asarray(tensor.data).reshape(num_experts * rows, -1)
    return decode_quantized(raw, kind, num_experts * rows, cols), rows


def _expert(stacked: tuple[GroupQuantWeight, int], expert: int, start: int, length: int) -> GroupQuantWeight:
    """Rows [start, start + length) of one expert of a stacked tensor."""
    w, rows = stacked
    first = expert * rows + start
    return take_rows(w, slice(first, first + length))


def experts_form(tensors: dict[str, Any], layer: int, moe: FusedMoE) -> ExpertsWq | None:
    """The local experts' forms of decoder layer `layer`, or None when its expert tensors are a
    plain type."""
    names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ModelLoadError(f"GGUF file has no tensor {missing[0]!r} for the MoE layer {layer}")
    gate, up, down = (stacked_group_quant(tensors[n]) for n in names)
    if gate is None or up is None or down is None:
        return None
    inter, start = moe.inter, moe.moe_tp_rank * moe.inter  # this rank's slice of each expert's width
    w13, w2 = [], []
    for local in range(moe.num_local):
        e = moe.expert_start + local
        w13.append(concat_rows([_expert(gate, e, start, inter), _expert(up, e, start, inter)]))
        down_e = _expert(down, e, 0, down[1])
        if down_e.in_features != inter:
            down_e = take_inputs(down_e, start, inter, names[2])
        w2.append(down_e)
    form = ExpertsWq(tuple(w13), tuple(w2))
    got = (form.w13[0].out_features, form.w13[0].in_features, form.w2[0].out_features, form.w2[0].in_features)
    want = (*moe.w13_weight.shape[1:], *moe.w2_weight.shape[1:])
    if got != tuple(want):
        raise ModelLoadError(
            f"GGUF expert tensors of layer {layer} make experts of shapes {got}, the model's are {want}"
        )
    return form
