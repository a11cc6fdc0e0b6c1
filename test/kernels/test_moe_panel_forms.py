"""Experts served from their stacked int8-activation panels alone (layers/moe/panel_forms.py): the
panels unpack to the very integers, scales and offsets they were made from (so the forms' own can
be dropped), PanelForms gives each expert's form from them, and the experts then hold the panels'
bytes only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_linear_wq import _weight  # random group-quantized weights of every form

from radixserve.layers import group_quant
from radixserve.layers.moe.panel_forms import PanelForms, unpack_panels
from radixserve.layers.moe.quantized import ExpertsWq, mark_int8_activations
from sgl_kernel.wq_a8_pack import pack_wq_a8, pack_wq_a8_experts

# (rows, inputs, bits, offsets, group): Q4_0 (offsets -8 x scale: not stored, re-formed), Q4_1-like
# offsets, Q8_0, groups of 64; rows not a multiple of the 8-row panel.
SHAPES = {
    "q4_0": (44, 96, 4, "zero8", 32),
    "q4-offsets": (40, 64, 4, True, 32),
    "q8": (19, 160, 8, False, 32),
    "q4-group64": (24, 128, 4, True, 64),
}


def _form(name: str, seed: int) -> group_quant.GroupQuantWeight:
    n, k, bits, offsets, group = SHAPES[name]
    w = _weight(n, k, bits, group, offsets is True, seed=seed)
    # GGUF's scales are fp16 values (the panels then store fp16); Q4_0's offsets are -8 x scale.
    scales = w.scales.half().float()
    return dataclasses.replace(w, scales=scales, offsets=scales * -8.0 if offsets == "zero8" else w.offsets)


@pytest.mark.parametrize("name", list(SHAPES))
def test_unpack_is_the_inverse_of_pack(name: str) -> None:
    w = _form(name, seed=1)
    qweight, scales, offsets = unpack_panels(pack_wq_a8(w.qweight, w.scales, w.offsets, w.bits, w.group_size))
    assert torch.equal(qweight, w.qweight) and qweight.dtype == w.qweight.dtype
    assert torch.equal(scales, w.scales) and scales.dtype == torch.float32
    assert (offsets is None) == (w.offsets is None)
    assert offsets is None or torch.equal(offsets, w.offsets)


def test_fp32_scales_unpack_too() -> None:
    w = _weight(16, 64, 4, 32, True, seed=3)  # scales that are not fp16 values: stored fp32
    pack = pack_wq_a8(w.qweight, w.scales, w.offsets, w.bits, w.group_size)
    assert pack.scales.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(unpack_panels(pack), (w.qweight, w.scales, w.offsets)))


@pytest.mark.parametrize("name", list(SHAPES))
def test_panel_forms_give_each_expert_as_it_was(name: str) -> None:
    forms = [_form(name, seed=10 + e) for e in range(3)]
    stacked = pack_wq_a8_experts(
        [(f.qweight, f.scales, f.offsets) for f in forms], forms[0].bits, forms[0].group_size
    )
    panel_forms = PanelForms(stacked)
    assert len(panel_forms) == 3
    for e, (got, want) in enumerate(zip(panel_forms, forms)):
        assert torch.equal(got.dequantize(), want.dequantize())
        assert got.int8_activations and got.a8_packed is not None
        assert got.a8_packed.q.data_ptr() == stacked.q[e].data_ptr()  # a view of the stack
    assert torch.equal(panel_forms[-1].qweight, forms[2].qweight)
    assert [f.qweight.shape for f in panel_forms[1:]] == [forms[1].qweight.shape, forms[2].qweight.shape]
    with pytest.raises(IndexError):
        panel_forms[3]
    assert panel_forms.nbytes() == stacked.nbytes()


@pytest.mark.skipif(not group_quant.WQ_A8_PACKED, reason="no panel kernel in this build")
def test_marked_with_panels_the_experts_hold_the_panels_only() -> None:
    w13 = tuple(_form("q4_0", seed=20 + e) for e in range(4))
    w2 = tuple(_form("q8", seed=30 + e) for e in range(4))
    exact = ExpertsWq(w13, w2)
    served = mark_int8_activations(exact, panels=True)
    assert isinstance(served.w13, PanelForms) and isinstance(served.w2, PanelForms)
    assert served.nbytes() == served.w13_panels.nbytes() + served.w2_panels.nbytes()
    # Q4_0 at the file's bytes: 18 bytes per 32 weights (fp16 scale, no offsets), rows padded to 8.
    assert served.w13_panels.nbytes() == 4 * 48 * (96 // 32) * 18
    w13_fp32, w2_fp32 = served.dequantize()
    want13, want2 = exact.dequantize()
    assert torch.equal(w13_fp32, want13) and torch.equal(w2_fp32, want2)
    # Without panels the forms stay as they are (the exact path), marked.
    kept = mark_int8_activations(exact, panels=False)
    assert kept.w13_panels is None and all(a.qweight is b.qweight for a, b in zip(kept.w13, w13))
