"""A GGUF MoE's routed experts, read from the file itself (its conversion folder leaves them out,
model_loader/gguf_source.py): the stacked `blk.N.ffn_{gate,up,down}_exps.weight` tensors (torch
order [num_experts, rows, cols]).

- --quantization gguf: each FusedMoE's local experts get the file's tensors as their weight-only
  forms (layers/moe/quantized.py), cut exactly as FusedMoE's fp32 loader cuts the per-expert
  tensors: this rank's experts (--ep-size), and of each its slice of the intermediate dimension
  (gate/up rows, down inputs: whole quantization groups only). The layer was built with its fp32
  weights on the meta device (FusedMoE.experts_on_meta) and never gets any.
- an fp32 model (--quantization unquant, other dtypes, a file whose experts are F32/F16/BF16): the
  layer's stacked weights are allocated and filled through FusedMoE.weight_loader from per-expert
  checkpoint tensors that dequantize one expert when read, so only this rank's experts are ever
  dequantized and never more than one expert's fp32 at a time beside the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from radixserve.layers.group_quant import GroupQuantWeight
from radixserve.layers.group_quant_ops import concat_rows, take_inputs, take_rows
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.quantized import DequantScratch, ExpertsWq
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_arch import GgufArch, expert_tensor_names, resolve_arch
from radixserve.model_loader.gguf_convert import read_metadata
from radixserve.model_loader.gguf_quant import GGUF_PLAIN_TYPES, check_tensor_types, decode_quantized
from radixserve.model_loader.weights import CheckpointTensor

ExpertForm = tuple[str, FusedMoE, ExpertsWq]
_PROJECTIONS = ("gate", "up", "down")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_rows(path: str, tensor: Any, first: int, count: int) -> np.ndarray:
    """Rows [first, first + count) of a GGUF tensor's bytes (a row: one output's blocks, along the
    fastest dimension) as uint8 [count, bytes per row], read from the file, not through the
    reader's memory map, whose touched pages would stay resident as long as the reader lives."""
    total_rows = tensor.n_elements // int(tensor.shape[0])
    row_bytes = tensor.n_bytes // total_rows
    offset = int(tensor.data_offset) + first * row_bytes
    data = np.fromfile(path, dtype=np.uint8, count=count * row_bytes, offset=offset)
    if data.size != count * row_bytes:
        raise ModelLoadError(f"{path} ends inside tensor {tensor.name}: the file is truncated")
    return data.reshape(count, row_bytes)


def stacked_group_quant(
    path: str, tensor: Any, first: int, count: int
) -> tuple[GroupQuantWeight, int] | None:
    """Experts [first, first + count) of a 3-D GGUF expert tensor as one GroupQuantWeight
    [count * rows, cols] and `rows` (one expert's), or None for the plain types (those experts
    serve in fp32)."""
    kind = tensor.tensor_type.name
    if kind in GGUF_PLAIN_TYPES:
        return None
    cols, rows, _ = (int(d) for d in tensor.shape.tolist())  # fastest dimension first
    return decode_quantized(
        read_rows(path, tensor, first * rows, count * rows), kind, count * rows, cols
    ), rows


def _expert(stacked: tuple[GroupQuantWeight, int], expert: int, start: int, length: int) -> GroupQuantWeight:
    """Rows [start, start + length) of one expert of a stacked tensor."""
    w, rows = stacked
    first = expert * rows + start
    return take_rows(w, slice(first, first + length))


def experts_form(path: str, tensors: dict[str, Any], layer: int, moe: FusedMoE) -> ExpertsWq | None:
    """The local experts' forms of decoder layer `layer` from GGUF file `path` (whose tensors by
    name are `tensors`), or None when its expert tensors are a plain type. Only this rank's
    experts are read, one projection at a time."""
    names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in _PROJECTIONS]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ModelLoadError(f"GGUF file has no tensor {missing[0]!r} for the MoE layer {layer}")
    if any(tensors[n].tensor_type.name in GGUF_PLAIN_TYPES for n in names):
        return None
    for name in names:
        if int(tensors[name].shape.tolist()[-1]) != moe.num_experts:
            raise ModelLoadError(f"GGUF tensor {name} does not hold the config's {moe.num_experts} experts")
    inter, start = moe.inter, moe.moe_tp_rank * moe.inter  # this rank's slice of each expert's width

    def read(name: str) -> tuple[GroupQuantWeight, int]:
        stacked = stacked_group_quant(path, tensors[name], moe.expert_start, moe.num_local)
        assert stacked is not None  # plain types returned above
        return stacked

    gate, up = read(names[0]), read(names[1])
    w13 = [
        concat_rows([_expert(gate, e, start, inter), _expert(up, e, start, inter)])
        for e in range(moe.num_local)
    ]
    del gate, up  # before the down projection is decoded: one stacked projection at a time
    down = read(names[2])
    w2 = []
    for e in range(moe.num_local):
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


def dequantize_expert(path: str, tensor: Any, expert: int, start: int, length: int) -> torch.Tensor:
    """fp32 rows [start, start + length) of one expert of a stacked GGUF tensor (any type gguf-py
    reads): a GGUF row is whole blocks, so only those rows' bytes are read and dequantized."""
    from gguf.quants import dequantize

    cols, rows, _ = (int(d) for d in tensor.shape.tolist())
    raw = read_rows(path, tensor, expert * rows + start, length)
    kind = tensor.tensor_type.name
    if kind in ("F32", "F16"):  # gguf-py reads these from arrays of their own dtype
        raw = raw.view(np.float32 if kind == "F32" else np.float16)
    values = dequantize(raw, tensor.tensor_type).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(length, cols))


def expert_tensor(path: str, name: str, tensor: Any, expert: int) -> CheckpointTensor:
    """Expert `expert` of stacked GGUF tensor `tensor` as the per-expert checkpoint tensor `name`,
    dequantized when read: a slice of rows reads those rows, of columns the expert's rows whole."""
    cols, rows, _ = (int(d) for d in tensor.shape.tolist())

    def read(dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return dequantize_expert(path, tensor, expert, start, length)
        return dequantize_expert(path, tensor, expert, 0, rows).narrow(dim, start, length)

    return CheckpointTensor(name, (rows, cols), read)


def _moe_layers(model: nn.Module) -> list[tuple[int, FusedMoE]]:
    """(decoder layer index, FusedMoE) of every MoE layer this rank builds."""
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ModelLoadError(f"{name}: a MoE layer outside model.layers.N cannot read GGUF experts")
            layers.append((int(match.group(1)), module))
    return layers


def _open(path: str) -> tuple[dict[str, Any], GgufArch]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # GGUFReader raises ValueError/struct errors on a bad file
        raise ModelLoadError(f"Cannot read GGUF file {path}: {exc}") from exc
    return {t.name: t for t in reader.tensors}, resolve_arch(read_metadata(reader))


def file_expert_weights(
    model: nn.Module, path: str, forms: bool, device: torch.device
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Give every MoE layer of `model` not yet served from forms its experts from the GGUF file
    `path`: with `forms` (--quantization gguf) the file's forms where its expert tensors are
    quantized; every other layer fp32 storage on `device`, and this iterator yields its local
    experts' tensors (HF names) for model.load_weights, dequantized one expert as each is read.

    The work happens as the iterator is consumed: chained after a checkpoint folder's tensors, the
    experts load once the dense weights are in and their read buffers freed."""
    tensors, arch = _open(path)
    scratch = DequantScratch()  # the forms' until the runner attaches its own (weight_only_forms.py)
    for layer, moe in _moe_layers(model):
        if moe.experts_wq is not None:
            continue  # a resume: the forms kept through the release hold these experts
        if forms:
            names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in _PROJECTIONS]
            check_tensor_types([tensors[n] for n in names if n in tensors])
            form = experts_form(path, tensors, layer, moe)
            if form is not None:
                moe.attach_quantized(form, scratch)
                continue
        moe.allocate_fp32(device)
        yield from _expert_tensors(path, tensors, arch, layer, moe)


def _expert_tensors(
    path: str, tensors: dict[str, Any], arch: GgufArch, layer: int, moe: FusedMoE
) -> Iterator[tuple[str, CheckpointTensor]]:
    for proj in _PROJECTIONS:
        gguf_name = f"blk.{layer}.ffn_{proj}_exps.weight"
        if gguf_name not in tensors:
            raise ModelLoadError(f"GGUF file has no tensor {gguf_name!r} for the MoE layer {layer}")
        stacked = int(tensors[gguf_name].shape.tolist()[-1])
        if stacked != moe.num_experts:
            raise ModelLoadError(
                f"GGUF tensor {gguf_name} holds {stacked} experts, the config {moe.num_experts}"
            )
        names = expert_tensor_names(gguf_name, arch, moe.num_experts)
        assert names is not None  # an `_exps` weight always has per-expert names
        for e in range(moe.expert_start, moe.expert_start + moe.num_local):
            yield names[e], expert_tensor(path, names[e], tensors[gguf_name], e)
