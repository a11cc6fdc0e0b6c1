"""Load a pre-quantized HF checkpoint (GPTQ / AWQ int4, compressed-tensors W8A8 int8:
configs/checkpoint_quant.py describes the formats).

Every quantized linear of the checkpoint is read as integers q, zero points z and scales s per
output channel and input ([N out, K in], groups expanded), and loads twice:

- as its fp32 weight, the exact dequantization s * (q - z): large batches (prefill) run the
  quantized model through the fp32 GEMM, and weight reads see what the checkpoint means;
- as its quantized form: GPTQ / AWQ as Linear.weight_wq, a GroupQuantWeight (bits 4, scale s,
  offset -s*z per group); compressed-tensors as the w8a8 forms Linear.weight_int8 / weight_scale,
  exactly what --quantization w8a8_int8 gives an fp32 checkpoint, and a MoE's routed experts as
  FusedMoE.experts_int8 (quantized_experts.py). A router the checkpoint quantized (most leave it
  out, `ignore`) is a plain nn.Linear and serves its exact fp32 dequantization.

Fusing (q/k/v into qkv_proj, gate/up into gate_up_proj) and tensor-parallel sharding are the
model's own weight loaders' work: the integers, the scales and the offsets are each loaded through
them as if they were the weight (one pass each, into the weight parameters, which the fp32 pass
then overwrites), so they end up exactly where the fp32 weight's elements do. A row-parallel
shard that would start or end inside a quantization group is refused.

Exactness: s is an fp16 value (11 significant bits) and q, z are integers of at most 5 bits
(GPTQ v1 zero points reach 16), so s * (q - z), q * s and s * z are exact in fp32 and
q * s + (-s * z) equals s * (q - z) bit for bit; the loader checks weight == weight_wq.dequantize().
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.configs.checkpoint_quant import AWQ, COMPRESSED_TENSORS, GPTQ, CheckpointQuant
from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.layers.linear import Linear
from radixserve.layers.parallel_linear import RowParallelLinear
from radixserve.model_loader import quantized_experts
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.weights import CheckpointTensor

logger = logging.getLogger(__name__)

# AutoAWQ's "gemm" layout: nibble i of a packed word holds output AWQ_ORDER[i] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PACK = 8  # 4-bit values per int32 word


@dataclass(frozen=True)
class Axis:
    """How one dimension of a stored tensor maps onto a logical axis: `factor` logical elements per
    stored element, either packed int4 nibbles (with their order) or a group's repeated value."""

    factor: int = 1
    packed: bool = False
    order: tuple[int, ...] | None = None


PLAIN = Axis()


def _unpack_int4(words: torch.Tensor, dim: int, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 words -> their 8 nibbles (0..15) along `dim`, nibble i of word w at 8w + i (or at the
    position `order` gives)."""
    moved = words.movedim(dim, -1).to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (moved.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8]
    if order is not None:  # nibble i is element order[i]: put element j where it belongs
        nibbles = nibbles[..., list(_inverse(order))]
    return nibbles.flatten(-2).movedim(-1, dim)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, element in enumerate(order):
        inv[element] = i
    return tuple(inv)


def _logical(t: CheckpointTensor, axes: tuple[Axis, Axis], dim: int, start: int, length: int) -> torch.Tensor:
    """Logical elements [start, start + length) along stored dim `dim` (all along the other),
    expanded: packed nibbles unpacked, group values repeated. Reads only the stored rows needed."""
    f = axes[dim].factor
    first, last = start // f, -(-(start + length) // f)
    raw = t.narrow(dim, first, last - first) if len(t.shape) > dim else t.full()
    if raw.dim() == 1:
        raw = raw.unsqueeze(1)  # a per-channel vector [N] as [N, 1]
    for d, axis in enumerate(axes):
        if axis.packed:
            raw = _unpack_int4(raw, d, axis.order)
        elif axis.factor > 1:
            raw = raw.repeat_interleave(axis.factor, dim=d)
    return raw.narrow(dim, start - first * f, length)


class QuantizedLinear:
    """One quantized linear of the checkpoint, read by output or input range as (q, z, s), each
    [n, k] in the weight's orientation (z None for symmetric int8)."""

    def __init__(
        self,
        prefix: str,
        shape: tuple[int, int],  # (N out, K in)
        q: tuple[CheckpointTensor, tuple[Axis, Axis]],
        s: tuple[CheckpointTensor, tuple[Axis, Axis]],
        z: tuple[CheckpointTensor, tuple[Axis, Axis]] | None,
        stored_transposed: bool,  # GPTQ / AWQ store [K, N]-oriented tensors
        zero_offset: int = 0,
    ) -> None:
        self.prefix, self.shape = prefix, shape
        self._q, self._s, self._z = q, s, z
        self._transposed = stored_transposed
        self._zero_offset = zero_offset

    @property
    def name(self) -> str:
        return self.prefix + ".weight"

    def read(
        self, dim: int, start: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        stored_dim = 1 - dim if self._transposed else dim

        def part(src: tuple[CheckpointTensor, tuple[Axis, Axis]]) -> torch.Tensor:
            got = _logical(src[0], src[1], stored_dim, start, length)
            return got.T if self._transposed else got

        q = part(self._q).to(torch.int32)
        s = part(self._s).to(torch.float32)
        z = None if self._z is None else part(self._z).to(torch.int32) + self._zero_offset
        return q, z, s

    def tensor(self, kind: str) -> CheckpointTensor:
        """A CheckpointTensor of the weight's shape: "weight" the fp32 dequantization s * (q - z),
        "q" the integers, "scale" s, "offset" -s * z (fp32, exact), per element."""

        def read(dim: int, start: int, length: int) -> torch.Tensor:
            if dim < 0:
                dim, start, length = 0, 0, self.shape[0]
            q, z, s = self.read(dim, start, length)
            if kind == "q":
                return q.to(torch.float32)
            if kind == "scale":
                return s
            if kind == "offset":
                return torch.zeros_like(s) if z is None else -(s * z.to(torch.float32))
            return s * (q if z is None else q - z).to(torch.float32)

        return CheckpointTensor(self.name, self.shape, read)


def split_checkpoint(
    tensors: Iterable[tuple[str, CheckpointTensor]], spec: CheckpointQuant
) -> tuple[list[tuple[str, CheckpointTensor]], list[QuantizedLinear]]:
    """(the checkpoint's other tensors, its quantized linears)."""
    by_name = dict(tensors)
    if spec.method == COMPRESSED_TENSORS:
        prefixes = [n.removesuffix(".weight_scale") for n in by_name if n.endswith(".weight_scale")]
        parts = (".weight", ".weight_scale")
        make = _compressed_tensors_linear
    else:
        prefixes = [n.removesuffix(".qweight") for n in by_name if n.endswith(".qweight")]
        parts = (".qweight", ".qzeros", ".scales", ".g_idx")
        make = _gptq_linear if spec.method == GPTQ else _awq_linear
    if not prefixes:
        raise ModelLoadError(
            f"config.json says the checkpoint is {spec.describe()}, but no tensor is stored that way "
            f"(no {parts[0] if spec.method != COMPRESSED_TENSORS else '.weight_scale'} tensors)"
        )
    linears = [make(p, by_name, spec) for p in prefixes]
    used = {p + part for p in prefixes for part in parts}
    for p in prefixes:
        for extra in (".weight_zero_point", ".input_scale"):
            if p + extra in by_name:
                raise ModelLoadError(f"{p}{extra}: this compressed-tensors variant is not supported")
    return [(n, t) for n, t in by_name.items() if n not in used], linears


def _need(by_name: dict[str, CheckpointTensor], name: str) -> CheckpointTensor:
    if name not in by_name:
        raise ModelLoadError(f"The quantized checkpoint lacks {name}")
    return by_name[name]


def _check_shapes(
    prefix: str, n: int, k: int, group: int, qzeros: CheckpointTensor, scales: CheckpointTensor
) -> None:
    groups = k // group
    expected = {"qzeros": (groups, n // _PACK), "scales": (groups, n)}
    for part, t in (("qzeros", qzeros), ("scales", scales)):
        if n % _PACK or tuple(t.shape) != expected[part]:
            raise ModelLoadError(
                f"{prefix}.{part} has shape {tuple(t.shape)}; a linear of {n} outputs and {k} inputs in "
                f"groups of {group} needs {expected[part]} (and outputs in multiples of {_PACK})"
            )


def _groups(prefix: str, spec: CheckpointQuant, k: int, stored_groups: int) -> int:
    """Inputs per group of this linear (checked against its stored scales)."""
    group = k if spec.group_size == -1 else spec.group_size
    if k % group or stored_groups != k // group:
        raise ModelLoadError(
            f"{prefix}: {k} inputs do not make {stored_groups} groups of {group} (the scales' rows); "
            "the checkpoint does not match its quantization_config"
        )
    return group


def _gptq_linear(prefix: str, by_name: dict[str, CheckpointTensor], spec: CheckpointQuant) -> QuantizedLinear:
    qweight, qzeros, scales = (_need(by_name, prefix + s) for s in (".qweight", ".qzeros", ".scales"))
    k, n = qweight.shape[0] * _PACK, qweight.shape[1]
    group = _groups(prefix, spec, k, scales.shape[0])
    _check_shapes(prefix, n, k, group, qzeros, scales)
    g_idx = by_name.get(prefix + ".g_idx")
    if g_idx is not None and not torch.equal(g_idx.full().to(torch.int64), torch.arange(k) // group):
        raise ModelLoadError(
            f"{prefix}.g_idx puts inputs in groups out of order (GPTQ desc_act / act-order): not "
            "supported, because the int4 kernels read each group's inputs as one contiguous run. "
            "Quantize with desc_act=False (or use a checkpoint made that way)."
        )
    packed = Axis(_PACK, packed=True)
    return QuantizedLinear(
        prefix,
        (n, k),
        q=(qweight, (packed, PLAIN)),
        s=(scales, (Axis(group), PLAIN)),
        z=(qzeros, (Axis(group), packed)),
        stored_transposed=True,
        zero_offset=spec.zero_offset,
    )


def _awq_linear(prefix: str, by_name: dict[str, CheckpointTensor], spec: CheckpointQuant) -> QuantizedLinear:
    qweight, qzeros, scales = (_need(by_name, prefix + s) for s in (".qweight", ".qzeros", ".scales"))
    k, n = qweight.shape[0], qweight.shape[1] * _PACK
    group = _groups(prefix, spec, k, scales.shape[0])
    _check_shapes(prefix, n, k, group, qzeros, scales)
    packed = Axis(_PACK, packed=True, order=AWQ_ORDER)
    return QuantizedLinear(
        prefix,
        (n, k),
        q=(qweight, (PLAIN, packed)),
        s=(scales, (Axis(group), PLAIN)),
        z=(qzeros, (Axis(group), packed)),
        stored_transposed=True,
    )


def _compressed_tensors_linear(
    prefix: str, by_name: dict[str, CheckpointTensor], spec: CheckpointQuant
) -> QuantizedLinear:
    weight, scale = _need(by_name, prefix + ".weight"), _need(by_name, prefix + ".weight_scale")
    n, k = weight.shape
    if weight.narrow(0, 0, 1).dtype != torch.int8:
        raise ModelLoadError(f"{prefix}.weight is not int8 although it has a weight_scale")
    if scale.shape not in ((n, 1), (n,)):
        raise ModelLoadError(
            f"{prefix}.weight_scale has shape {scale.shape}: expected one scale per output channel"
        )
    return QuantizedLinear(
        prefix,
        (n, k),
        q=(weight, (PLAIN, PLAIN)),
        s=(scale, (PLAIN, Axis(k))),
        z=None,
        stored_transposed=False,
    )


# ------------------------------------------------------------------------------------------ load


def load_quantized_weights(
    model: nn.Module, tensors: Iterable[tuple[str, CheckpointTensor]], spec: CheckpointQuant
) -> None:
    """Fill `model` from a pre-quantized checkpoint: fp32 weights (exact dequantizations) and the
    quantized forms of every quantized linear (module docstring)."""
    plain, quantized = split_checkpoint(tensors, spec)
    plain = _without_extra_biases(model, plain, {lin.prefix for lin in quantized})
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    # The routed experts of a W8A8 MoE (quantized_experts.py); int4 experts load as fp32.
    moes = quantized_experts.expert_layers(model) if spec.method == COMPRESSED_TENSORS else {}
    kinds = ("q", "scale") if spec.method == COMPRESSED_TENSORS else ("q", "scale", "offset")
    planes: dict[str, dict[str, torch.Tensor]] = {}
    moe_planes: dict[str, quantized_experts.Planes] = {}
    for kind in kinds:
        with torch.no_grad():
            for layer in linears.values():
                layer.weight.data.fill_(float("nan"))  # marks what the pass does not write
        quantized_experts.mark_unwritten(moes)
        model.load_weights([(lin.name, lin.tensor(kind)) for lin in quantized], require_all=False)
        for name, layer in linears.items():
            plane = _harvest(name, layer, kind, spec)
            if plane is not None:
                planes.setdefault(name, {})[kind] = plane
        quantized_experts.harvest(moes, kind, moe_planes)
    model.load_weights(plain + [(lin.name, lin.tensor("weight")) for lin in quantized])
    for name, forms in planes.items():
        _attach(name, linears[name], forms, spec)
    num_moes = quantized_experts.attach(moes, moe_planes)
    logger.info(
        "%s checkpoint: %d checkpoint linears into %d quantized layers (%s)%s",
        spec.describe(),
        len(quantized),
        len(planes) + num_moes,
        "weight_int8 / weight_scale, W8A8"
        if spec.method == COMPRESSED_TENSORS
        else "weight_wq, int4 weight-only",
        f", {num_moes} of them MoE layers' routed experts" if num_moes else "",
    )


def _without_extra_biases(
    model: nn.Module, plain: list[tuple[str, CheckpointTensor]], quantized: set[str]
) -> list[tuple[str, CheckpointTensor]]:
    """AutoGPTQ writes a bias for every quantized linear, zeros where the model has none (Llama):
    those are dropped, as SGLang's loaders do; a non-zero one the model has no place for is refused."""
    params = dict(model.named_parameters())
    targets = getattr(model, "param_targets", lambda name: [name])
    kept = []
    for name, t in plain:
        extra = name.endswith(".bias") and name.removesuffix(".bias") in quantized
        if extra and not all(target in params for target in targets(name)):
            if bool(t.full().any()):
                raise ModelLoadError(f"{name} is not zero, but the model has no bias there")
            continue
        kept.append((name, t))
    return kept


def _group_of(name: str, layer: Linear, spec: CheckpointQuant) -> int:
    """Inputs per group on this rank; refuses a row-parallel shard that splits a group."""
    k = layer.weight.shape[1]
    if spec.group_size == -1:
        return k  # one scale per output channel: any input range keeps it
    group = spec.group_size
    if isinstance(layer, RowParallelLinear) and (layer.input_start % group or layer.input_size % group):
        raise ModelLoadError(
            f"{name}: this tensor-parallel rank's inputs [{layer.input_start}, "
            f"{layer.input_start + layer.input_size}) split a quantization group of {group} inputs; "
            "choose a --tp-size whose shards hold whole groups"
        )
    return group


def _harvest(name: str, layer: Linear, kind: str, spec: CheckpointQuant) -> torch.Tensor | None:
    """What a plane pass wrote into `layer`'s weight, compacted: None when the layer is not
    quantized; q as uint8 / int8, scales and offsets one value per group."""
    w = layer.weight.detach()
    missing = torch.isnan(w)
    if bool(missing.all()):
        return None
    if bool(missing.any()):
        raise ModelLoadError(
            f"{name} fuses quantized and unquantized projections (the checkpoint quantizes only some "
            "of them); radixserve needs all or none quantized"
        )
    if kind == "q":
        return w.to(torch.int8 if spec.method == COMPRESSED_TENSORS else torch.uint8)
    group = _group_of(name, layer, spec)
    per_group = w.reshape(w.shape[0], -1, group)
    compact = per_group[:, :, 0].contiguous()
    if not torch.equal(per_group, compact.unsqueeze(-1).expand_as(per_group)):
        raise ModelLoadError(f"{name}: the {kind}s are not constant within groups of {group} inputs")
    return compact.squeeze(1) if spec.method == COMPRESSED_TENSORS else compact


def _attach(name: str, layer: Linear, forms: dict[str, torch.Tensor], spec: CheckpointQuant) -> None:
    if spec.method == COMPRESSED_TENSORS:
        layer.weight_int8, layer.weight_scale = forms["q"].contiguous(), forms["scale"].contiguous()
        dequantized = layer.weight_int8.float() * layer.weight_scale.unsqueeze(1)
    else:
        group = layer.weight.shape[1] // forms["scale"].shape[1]
        layer.weight_wq = GroupQuantWeight(pack_int4(forms["q"]), forms["scale"], forms["offset"], group, 4)
        dequantized = layer.weight_wq.dequantize()
    if not torch.equal(dequantized, layer.weight.detach()):
        raise ModelLoadError(
            f"{name}: the quantized form does not dequantize to the loaded weight (a loader bug)"
        )


__all__ = ["AWQ", "GPTQ", "QuantizedLinear", "load_quantized_weights", "split_checkpoint"]
