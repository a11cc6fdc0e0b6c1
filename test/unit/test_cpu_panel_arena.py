"""cpu_panel_arena.gather_panels: every linear's int8-activation panels moved into one buffer in
the given order, as views the forms then hold: the same bytes (so the same products, bit for bit,
on the panel kernel), laid end to end on cache-line boundaries, and nothing done where no
linear has panels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.layers import group_quant
from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.model_executor.cpu_panel_arena import ALIGN, gather_panels
from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not group_quant.WQ_A8_PACKED, reason="no AVX2 panel kernel in this build")


def _form(n: int, k: int, bits: int, seed: int, offsets: bool) -> GroupQuantWeight:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    else:
        qweight = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    offs = (torch.rand(n, k // 32, generator=g) - 0.5).half().float() if offsets else None
    return group_quant.with_int8_activations(GroupQuantWeight(qweight, scales, offs, 32, bits), panels=True)


def _linear(x: torch.Tensor, w: GroupQuantWeight) -> torch.Tensor:
    return cpu_kernels.linear_wq_a8(
        x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None, packed=w.a8_packed
    )


def test_panels_move_into_one_buffer_with_the_same_products() -> None:
    forms = [_form(37, 64, 4, 0, True), _form(16, 96, 8, 1, False), _form(72, 64, 4, 2, True)]
    linears = [SimpleNamespace(weight_wq=w) for w in forms]
    linears.insert(1, SimpleNamespace(weight_wq=None))  # a linear without a form is passed over
    xs = [
        torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(i)) for i, w in enumerate(forms)
    ]
    before = [_linear(x, w) for x, w in zip(xs, forms)]
    buffer = gather_panels(linears)
    assert buffer is not None and buffer.dtype == torch.uint8
    moved = [lin.weight_wq for lin in linears if lin.weight_wq is not None]
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    at = start
    for old, new in zip(forms, moved):
        for name in ("q", "scales", "offsets"):
            a, b = getattr(old.a8_packed, name), getattr(new.a8_packed, name)
            if a is None:
                assert b is None
                continue
            assert torch.equal(a, b) and a.dtype == b.dtype and b.is_contiguous()
            # In the given order, each on a cache line, end to end within the buffer.
            assert b.data_ptr() == at and (b.data_ptr() - start) % ALIGN == 0
            at += -(-b.numel() * b.element_size() // ALIGN) * ALIGN
        assert new.qweight is old.qweight and new.int8_activations
    assert at == end
    after = [_linear(x, w) for x, w in zip(xs, moved)]
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_nothing_to_gather() -> None:
    plain = GroupQuantWeight(pack_int4(torch.randint(0, 16, (8, 64))), torch.rand(8, 2), None, 32, 4)
    linears = [SimpleNamespace(weight_wq=None), SimpleNamespace(weight_wq=plain)]
    assert gather_panels(linears) is None
    assert linears[1].weight_wq is plain
