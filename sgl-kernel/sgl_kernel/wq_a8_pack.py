"""A weight-only quantized weight repacked for linear_wq_a8's panel kernel
(csrc/cpu/linear_wq_a8_packed.cpp): 8 output rows per panel, each 32-byte load holding 4 bytes of
each of the 8 rows, so that one vector lane is one output row.

Made once, when a form is marked for int8 activations (layers/group_quant.py); a pure re-layout of
the same integers and scales (no rounding), so the packed product equals the canonical one up to
fp32 summation order. Costs one more copy of the integers and scales (rows padded to a multiple of
8), and a permute per weight at load.

The per-group numbers take the file's bytes where that loses nothing: scales (and offsets) are
stored fp16 when every one of them is an fp16 value (GGUF's are), and offsets that are exactly
-zero * scale (Q4_0's zero of 8) are not stored at all, the kernel forming them from the scales.
So a Q4_0 row-block of 32 inputs is 18 bytes, Q8_0's 34, Q4_1's 20: what the file holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PANEL = 8  # output rows per panel: one per int32 lane of a 256-bit vector
BLOCK = 32  # inputs per int8 activation scale


@dataclass(frozen=True)
class _PanelParts:
    """The panel layout's integers, scales and offsets (None: w = scale * (q - zero_point)), the weight's
    output rows n (before padding to whole panels), bits and group size: one weight's, or every
    expert's stacked on a leading dimension."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    n: int
    bits: int
    group_size: int
    zero_point: int = 0

    def nbytes(self) -> int:
        return _nbytes(self.q, self.scales, self.offsets)


def _nbytes(*parts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def zero_point_of(scales: torch.Tensor, offsets: torch.Tensor | None, bits: int) -> int:
    """8 where int4 offsets are exactly -8 * scale in fp32 (Q4_0, symmetric GPTQ: the kernel forms
    them from the scales with the same product, so the numbers keep every bit), else 0."""
    if bits != 4 or offsets is None or offsets.shape != scales.shape:
        return 0
    return 8 if torch.equal(offsets, scales.float() * -8.0) else 0


def group_dtype(*parts: torch.Tensor | None) -> torch.dtype:
    """fp16 where every value of the parts survives fp16 exactly (GGUF's scales), else fp32."""
    for t in parts:
        if t is not None and not torch.equal(t.float().half().float(), t.float()):
            return torch.float32
    return torch.float16


@dataclass(frozen=True)
class WqA8Packed(_PanelParts):
    """q: bits 4: uint8 [P, K // 32, 128], bits 8: int8 [P, K // 32, 256] (P = ceil(n / 8));
    scales, offsets: fp16 or fp32 [P, K // group_size, 8] (offsets None: w = scale * (q -
    zero_point))."""


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _panel_groups(t: torch.Tensor, panels: int) -> torch.Tensor:
    """[N, groups] -> [P, groups, 8], rows past N zero."""
    groups = t.shape[1]
    return _pad_rows(t, panels * PANEL).reshape(panels, PANEL, groups).transpose(1, 2).contiguous()


def pack_wq_a8(
    qweight: torch.Tensor,  # bits 8: int8 [N, K]; bits 4: uint8 [N, K // 2], input 2j in byte j's low nibble
    scales: torch.Tensor,  # [N, K // group_size] fp32
    offsets: torch.Tensor | None,  # [N, K // group_size] fp32, or None
    bits: int,
    group_size: int,  # a multiple of 32
    zero_point: int | None = None,  # None: zero_point_of's
    dtype: torch.dtype | None = None,  # of scales / offsets; None: group_dtype's
) -> WqA8Packed:
    """The panel layout: chunk c of block b of panel p holds, for each of its 8 rows, the row's
    block bytes 4c..4c+3 (int4: 4 chunks of a 16-byte block; int8: 8 chunks of a 32-byte one).
    With a zero point the offsets are dropped (they must be -zero_point * scale)."""
    n, row_bytes = qweight.shape
    k = row_bytes * (2 if bits == 4 else 1)
    if bits not in (4, 8) or group_size % BLOCK or k % group_size:
        raise ValueError(f"pack_wq_a8: bits {bits}, group_size {group_size}, K {k} not packable")
    panels, blocks = -(-n // PANEL), k // BLOCK
    chunks = 4 if bits == 4 else 8
    q = _pad_rows(qweight, panels * PANEL).reshape(panels, PANEL, blocks, chunks, 4)
    q = q.permute(0, 2, 3, 1, 4).reshape(panels, blocks, chunks * PANEL * 4).contiguous()
    zero = zero_point_of(scales, offsets, bits) if zero_point is None else zero_point
    if zero and zero_point_of(scales, offsets, bits) != zero:
        raise ValueError(f"pack_wq_a8: offsets are not -{zero} * scale; zero_point {zero} would change them")
    kept = None if zero else offsets
    dtype = group_dtype(scales, kept) if dtype is None else dtype
    packed_offsets = None if kept is None else _panel_groups(kept, panels).to(dtype)
    return WqA8Packed(q, _panel_groups(scales, panels).to(dtype), packed_offsets, n, bits, group_size, zero)


@dataclass(frozen=True)
class WqA8PackedExperts(_PanelParts):
    """pack_wq_a8 of every expert of one MoE projection, stacked: q [E, P, K // 32, 128 | 256],
    scales / offsets fp16 or fp32 [E, P, K // group_size, 8]; expert e's pack is `expert(e)`
    (views), so the per-expert products and moe_wq_a8_packed read the same bytes."""

    def expert(self, e: int) -> WqA8Packed:
        offsets = None if self.offsets is None else self.offsets[e]
        return WqA8Packed(
            self.q[e], self.scales[e], offsets, self.n, self.bits, self.group_size, self.zero_point
        )


def pack_wq_a8_experts(
    weights: Sequence[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    ],  # per expert (qweight, scales, offsets)
    bits: int,
    group_size: int,
) -> WqA8PackedExperts:
    """pack_wq_a8 of each expert's weight (all of one shape, all with or all without offsets), written
    into one stacked tensor per part as it is made (at most one expert's pack exists apart). One
    zero point and one dtype for all: those every expert allows."""
    if not weights or len({(q.shape, o is None) for q, _, o in weights}) != 1:
        raise ValueError("pack_wq_a8_experts: the experts' weights must share one shape and offsets or not")
    zeros = {zero_point_of(s, o, bits) for _, s, o in weights}
    zero = zeros.pop() if len(zeros) == 1 else 0
    kept = [(s, None if zero else o) for _, s, o in weights]
    dtype = torch.float16 if all(group_dtype(s, o) == torch.float16 for s, o in kept) else torch.float32
    first = pack_wq_a8(*weights[0], bits, group_size, zero, dtype)
    num = len(weights)
    q = first.q.new_empty((num, *first.q.shape))
    scales = first.scales.new_empty((num, *first.scales.shape))
    offsets = None if first.offsets is None else first.offsets.new_empty((num, *first.offsets.shape))
    for e, (qweight, s, o) in enumerate(weights):
        pack = first if e == 0 else pack_wq_a8(qweight, s, o, bits, group_size, zero, dtype)
        q[e].copy_(pack.q)
        scales[e].copy_(pack.scales)
        if offsets is not None:
            offsets[e].copy_(pack.offsets)
    return WqA8PackedExperts(q, scales, offsets, first.n, bits, group_size, zero)
