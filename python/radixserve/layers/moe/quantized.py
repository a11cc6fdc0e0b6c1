"""Weight-only quantized experts (--quantization gguf on a MoE file): each local expert's gate/up
and down projections as GroupQuantWeights, the GGUF file's own integers and scales.

Once attached (FusedMoE.attach_quantized) they are the experts' only resident form: the fp32
stacked weights are dropped (their storage freed, their shapes kept on the meta device), so a Q4
MoE holds its file's bytes, not ~8x that in fp32. Small groups, the decode case, stream the
integers through linear_wq; a group larger than DROPPED_WQ_MAX_TOKENS (fused_moe_cpu.py) dequantizes its expert's projection
into one fp32 scratch buffer shared by every layer (DequantScratch) and runs the fp32 GEMM on it,
as a dense Linear's large batches run fp32 (layers/linear.py). The dequantization is exact (the
forms' own fp32 products), so results equal the old fp32 copy's bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.layers import group_quant
from radixserve.layers.group_quant import ACT_BLOCK, GroupQuantWeight, with_int8_activations
from radixserve.layers.moe.panel_forms import PanelForms


@dataclass(frozen=True)
class ExpertsWq:
    """w13[e]: local expert e's gate rows then up rows [2 * inter, hidden_size]; w2[e]: its down
    projection [hidden_size, inter] (FusedMoE's w13_weight / w2_weight layout, one expert each).

    w13_panels / w2_panels: every expert's int8-activation panels of the projection stacked in one
    tensor (sgl_kernel's WqA8PackedExperts; each form's a8_packed is a view of its expert's part),
    which moe_wq_a8_packed reads in one call for every batch (fused_moe_a8.py); None where the
    experts do not serve on int8 activations (Crossovers.moe_a8, model_executor/cpu_tuning_moe.py)
    or the panel kernel is not built. With panels, w13 / w2 are PanelForms (panel_forms.py): the
    forms' own integers were dropped, and a form asked for is unpacked from the panels."""

    w13: Sequence[GroupQuantWeight]
    w2: Sequence[GroupQuantWeight]
    w13_panels: Any = None
    w2_panels: Any = None

    def __post_init__(self) -> None:
        if len(self.w13) != len(self.w2):
            raise ValueError(f"{len(self.w13)} gate/up forms but {len(self.w2)} down forms")

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (w13 [num_local, 2 * inter, hidden], w2 [num_local, hidden, inter])."""
        return (
            torch.stack([w.dequantize() for w in self.w13]),
            torch.stack([w.dequantize() for w in self.w2]),
        )

    def nbytes(self) -> int:
        """Resident bytes of the experts: the panels where they serve (the only copy), else the forms'."""
        if self.w13_panels is not None:
            return self.w13_panels.nbytes() + self.w2_panels.nbytes()
        return sum(w.nbytes() for w in (*self.w13, *self.w2))


def _mark(form: GroupQuantWeight, panels: bool) -> GroupQuantWeight:
    """form marked for int8 activations where its groups allow it (multiples of 32 inputs)."""
    return form if form.group_size % ACT_BLOCK else with_int8_activations(form, panels=panels)


def _stack_panels(forms: Sequence[GroupQuantWeight]) -> tuple[tuple[GroupQuantWeight, ...], Any]:
    """forms (one projection of every expert) given panels stacked in one tensor, each form's
    a8_packed a view of its own part, and the stack; (forms, None) unchanged where they are not all
    marked, differ in layout, or the panel kernel is not built."""
    first = forms[0]
    layouts = {(f.bits, f.group_size, f.qweight.shape, f.offsets is None) for f in forms}
    if (
        len(layouts) != 1
        or not all(f.int8_activations for f in forms)
        or not group_quant.WQ_A8_PACKED
        or first.qweight.device.type != "cpu"
    ):
        return tuple(forms), None
    stacked = group_quant.cpu_kernels.pack_wq_a8_experts(
        [(f.qweight, f.scales, f.offsets) for f in forms], first.bits, first.group_size
    )
    return tuple(dataclasses.replace(f, a8_packed=stacked.expert(e)) for e, f in enumerate(forms)), stacked


def mark_int8_activations(experts: ExpertsWq, panels: bool) -> ExpertsWq:
    """experts with each form marked for int8 activations where its groups allow it, and with
    `panels` (Crossovers.moe_a8: the experts serve on int8 activations) each projection's panels
    made once and stacked over the experts, the forms' own integers then dropped (PanelForms: one
    resident copy of the expert bytes); where stacking cannot be (forms of different layouts, no
    panel kernel) each form gets its own panels beside its integers."""
    w13 = [_mark(f, False) for f in experts.w13]
    w2 = [_mark(f, False) for f in experts.w2]
    if not panels or not w13:
        return ExpertsWq(tuple(w13), tuple(w2))
    (_, w13_panels), (_, w2_panels) = _stack_panels(w13), _stack_panels(w2)
    if w13_panels is not None and w2_panels is not None:
        return ExpertsWq(PanelForms(w13_panels), PanelForms(w2_panels), w13_panels, w2_panels)
    return ExpertsWq(tuple(_mark(f, True) for f in experts.w13), tuple(_mark(f, True) for f in experts.w2))


class DequantScratch:
    """One fp32 buffer that large expert groups dequantize their projection into, reused by every
    group of every layer (a forward runs one group at a time), grown to the largest projection
    asked for. Resident cost: one expert projection in fp32."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32)

    def dequantize(self, form: GroupQuantWeight) -> torch.Tensor:
        """form's fp32 weight [out, in], valid until the next call."""
        n, k = form.out_features, form.in_features
        if self._buffer.numel() < n * k or self._buffer.device != form.qweight.device:
            self._buffer = torch.empty(n * k, dtype=torch.float32, device=form.qweight.device)
        return form.dequantize(out=self._buffer[: n * k].view(n, k))

    def nbytes(self) -> int:
        return self._buffer.numel() * 4
