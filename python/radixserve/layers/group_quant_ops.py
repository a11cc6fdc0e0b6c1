"""Reshaping GroupQuantWeights without touching their numbers: the row and input slices a
tensor-parallel rank holds, the fusion of projections (q/k/v, gate/up) and vocabulary padding.

Every operation keeps each weight's integers, scales and offsets; `concat_rows` of parts in
different formats widens them to a common one (8 bits, the finest group, zero offsets where a part
had none), which dequantizes to the same values (a zero offset only turns -0.0 into +0.0).
"""

from __future__ import annotations

import math

import torch

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.model_loader.errors import ModelLoadError


def _rebuild(
    w: GroupQuantWeight, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> GroupQuantWeight:
    return GroupQuantWeight(
        qweight.contiguous(),
        scales.contiguous(),
        None if offsets is None else offsets.contiguous(),
        w.group_size,
        w.bits,
    )


def take_rows(w: GroupQuantWeight, index: torch.Tensor | slice) -> GroupQuantWeight:
    """Output channels `index` (a slice or a tensor of row indices)."""
    offsets = None if w.offsets is None else w.offsets[index]
    return _rebuild(w, w.qweight[index], w.scales[index], offsets)


def take_inputs(w: GroupQuantWeight, start: int, length: int, name: str) -> GroupQuantWeight:
    """Inputs [start, start + length) of every output channel: whole groups only (a row-parallel
    rank's shard). A shard boundary inside a group is refused: the group's scale belongs to both
    sides."""
    g = w.group_size
    if start % g or length % g:
        raise ModelLoadError(
            f"{name}: this tensor-parallel rank's inputs [{start}, {start + length}) split a quantization "
            f"group of {g} inputs; choose a --tp-size whose shards hold whole groups"
        )
    per_byte = 2 if w.bits == 4 else 1
    qweight = w.qweight[:, start // per_byte : (start + length) // per_byte]
    groups = slice(start // g, (start + length) // g)
    offsets = None if w.offsets is None else w.offsets[:, groups]
    return _rebuild(w, qweight, w.scales[:, groups], offsets)


def widen(w: GroupQuantWeight, bits: int, group_size: int, with_offsets: bool) -> GroupQuantWeight:
    """The same values as a weight of `bits` bits, groups of `group_size` (dividing w's) and
    offsets when `with_offsets`."""
    if (bits, group_size, with_offsets) == (w.bits, w.group_size, w.offsets is not None):
        return w
    if w.group_size % group_size or bits < w.bits:
        raise ValueError(
            f"cannot widen {w.bits}-bit groups of {w.group_size} to {bits}-bit groups of {group_size}"
        )
    repeat = w.group_size // group_size
    scales = w.scales.repeat_interleave(repeat, dim=1)
    offsets = None if w.offsets is None else w.offsets.repeat_interleave(repeat, dim=1)
    if with_offsets and offsets is None:
        offsets = torch.zeros_like(scales)
    q = w.integers()
    qweight = q.to(torch.int8) if bits == 8 else pack_int4(q)
    return GroupQuantWeight(qweight.contiguous(), scales.contiguous(), offsets, group_size, bits)


def concat_rows(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
    """Stack weights of the same inputs along the output dimension (a fused projection)."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group_size = math.gcd(*(p.group_size for p in parts))
    with_offsets = any(p.offsets is not None for p in parts)
    parts = [widen(p, bits, group_size, with_offsets) for p in parts]
    offsets = torch.cat([p.offsets for p in parts]) if with_offsets else None  # type: ignore[misc]
    return GroupQuantWeight(
        torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), offsets, group_size, bits
    )


def pad_rows(w: GroupQuantWeight, rows: int) -> GroupQuantWeight:
    """w followed by zero output channels up to `rows` (the padding of a vocab-parallel block)."""
    extra = rows - w.out_features
    if extra <= 0:
        return w

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])

    offsets = None if w.offsets is None else pad(w.offsets)
    return _rebuild(w, pad(w.qweight), pad(w.scales), offsets)
