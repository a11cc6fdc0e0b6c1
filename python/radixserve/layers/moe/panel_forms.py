"""Experts served from their int8-activation panels alone: one resident copy of the expert bytes.

The stacked panels (sgl_kernel's WqA8PackedExperts) are a lossless re-layout of each expert's
integers and scales (fp16 only where every scale is an fp16 value; Q4_0's offsets, -8 x scale,
re-formed from the scales by the same fp32 product). So once a projection's panels are made, the
forms' own integers can go: `PanelForms` gives expert e's GroupQuantWeight on demand by unpacking
its part of the panels (`unpack_panels`, the exact inverse of pack_wq_a8). The one-call kernel
(fused_moe_a8.py) reads the panels directly and never asks; what asks is the rest: the grouped
path where the kernel cannot run (a torch reference forced by a test, non-fp32 activations), a
weight read or update, which dequantize one expert (bit-equal to the dropped form's
dequantization: test/unit/test_moe_panel_forms.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch

from radixserve.layers.group_quant import GroupQuantWeight

PANEL = 8  # output rows per panel (sgl_kernel.wq_a8_pack.PANEL)


def unpack_panels(pack: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # noqa: ANN401 - WqA8Packed
    """(qweight, fp32 scales, fp32 offsets or None) of one weight's panels (a WqA8Packed): what
    pack_wq_a8 was given, bit for bit (test/unit/test_moe_panel_forms.py)."""
    panels, blocks, width = pack.q.shape
    chunks = width // (PANEL * 4)  # int4: 4 chunks of a 16-byte block, int8: 8 of a 32-byte one
    q = pack.q.reshape(panels, blocks, chunks, PANEL, 4).permute(0, 3, 1, 2, 4)
    qweight = q.reshape(panels * PANEL, blocks * chunks * 4)[: pack.n].contiguous()
    scales = _rows(pack.scales, pack.n)
    if pack.offsets is not None:
        offsets = _rows(pack.offsets, pack.n)
    elif pack.zero_point:
        # The same fp32 product zero_point_of checked the file's offsets against before dropping them.
        offsets = scales * -float(pack.zero_point)
    else:
        offsets = None
    return qweight, scales, offsets


def _rows(groups: torch.Tensor, n: int) -> torch.Tensor:
    """[P, groups, 8] fp16 / fp32 -> fp32 [n, groups]."""
    panels, num_groups, _ = groups.shape
    return groups.transpose(1, 2).reshape(panels * PANEL, num_groups)[:n].to(torch.float32).contiguous()


@dataclasses.dataclass(frozen=True)
class PanelForms(Sequence[GroupQuantWeight]):
    """One projection's per-expert forms, made from its stacked panels when asked for (each marked
    for int8 activations, with its part of the panels as a8_packed); holds no integers of its own.
    Indexing materializes one expert (a few ms for a 1536 x 2048 projection): for the paths that
    are not the one-call kernel's."""

    panels: Any  # WqA8PackedExperts

    def __len__(self) -> int:
        return self.panels.q.shape[0]

    @overload
    def __getitem__(self, e: int) -> GroupQuantWeight: ...

    @overload
    def __getitem__(self, e: slice) -> Sequence[GroupQuantWeight]: ...

    def __getitem__(self, e: int | slice) -> GroupQuantWeight | Sequence[GroupQuantWeight]:
        if isinstance(e, slice):
            return [self[i] for i in range(len(self))[e]]
        if not -len(self) <= e < len(self):
            raise IndexError(f"expert {e} of {len(self)}")
        pack = self.panels.expert(e % len(self))
        qweight, scales, offsets = unpack_panels(pack)
        return GroupQuantWeight(
            qweight, scales, offsets, pack.group_size, pack.bits, int8_activations=True, a8_packed=pack
        )

    def __iter__(self) -> Iterator[GroupQuantWeight]:
        return (self[e] for e in range(len(self)))

    def nbytes(self) -> int:
        return self.panels.nbytes()
