"""GroupQuantWeight (layers/group_quant.py): the representation every weight-only format maps onto."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.cpu_crossovers import DEFAULTS
from radixserve.layers.group_quant import GroupQuantWeight, linear_wq, linear_wq_reference, pack_int4
from radixserve.layers.linear import Linear

# The bounds the tests run with (the test suite sets --cpu-kernel-tuning off: the defaults).
WQ_MAX_TOKENS = DEFAULTS.wq_max_tokens


def _int4(n: int = 6, k: int = 64, group: int = 32) -> tuple[GroupQuantWeight, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g)
    offsets = torch.rand(n, k // group, generator=g) - 0.5
    expected = q.float() * scales.repeat_interleave(group, 1) + offsets.repeat_interleave(group, 1)
    return GroupQuantWeight(pack_int4(q), scales, offsets, group, 4), expected


def test_int4_unpacks_low_nibble_first_and_dequantizes_per_group() -> None:
    w, expected = _int4()
    assert w.in_features == 64 and w.out_features == 6
    assert torch.equal(w.dequantize(), expected)
    assert w.nbytes() == 6 * 32 + 2 * 6 * 2 * 4


def test_int8_without_offsets() -> None:
    q = torch.tensor([[-128, 127] * 8], dtype=torch.int8)
    w = GroupQuantWeight(q, torch.tensor([[0.5]]), None, 16, 8)
    assert torch.equal(w.dequantize(), q.float() * 0.5)


def test_strided_forms_dequantize_like_contiguous_ones() -> None:
    """dequantize broadcasts the scales over [N, groups, group_size] views: forms over strided
    tensors (every other row here) must give the same bits as their contiguous copies."""
    w, expected = _int4(n=8)
    rows = GroupQuantWeight(w.qweight[::2], w.scales[::2], w.offsets[::2], 32, 4)
    assert not rows.qweight.is_contiguous()
    assert torch.equal(rows.dequantize(), expected[::2])
    q = torch.randint(-128, 128, (8, 32), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    w8 = GroupQuantWeight(q[::2], torch.rand(8, 2)[::2], None, 16, 8)
    assert torch.equal(w8.dequantize(), q[::2].float() * w8.scales.repeat_interleave(16, 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"group_size": 24}, "multiple of 16"),
        ({"scales": torch.ones(6, 3)}, "scales must be fp32"),
        ({"qweight": torch.zeros(6, 32, dtype=torch.int8)}, "4-bit qweight must be"),
    ],
)
def test_malformed_weights_are_refused(kwargs: dict, message: str) -> None:
    w, _ = _int4()
    fields = {"qweight": w.qweight, "scales": w.scales, "offsets": w.offsets, "group_size": 32, "bits": 4}
    with pytest.raises(ValueError, match=message):
        GroupQuantWeight(**{**fields, **kwargs})


def test_linear_runs_the_quantized_form_up_to_its_bound_and_the_fp32_weight_above() -> None:
    w, expected = _int4()
    layer = Linear(64, 6, bias=False)
    # A weight that differs from the quantized one tells which form ran.
    layer.weight.data = expected + 1.0
    layer.weight_wq = w
    small = torch.randn(WQ_MAX_TOKENS, 64)
    torch.testing.assert_close(layer(small), linear_wq_reference(small, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_wq(small, w), small @ expected.T, rtol=1e-5, atol=1e-5)
    large = torch.randn(WQ_MAX_TOKENS + 1, 64)
    torch.testing.assert_close(layer(large), large @ (expected + 1.0).T, rtol=1e-5, atol=1e-5)
    layer.drop_derived()
    assert layer.weight_wq is None
