"""linear_wq with fp16 scales and offsets (GGUF's d and m as stored) against the same kernel on fp32
copies of the same values: widened exactly, so every path must give the same bits; and the fused
decode stack's choice of those copies (cpu_decode_runner.half_groups)."""

from __future__ import annotations

import pytest
import torch
from wq_weights import random_wq_weight

from radixserve.model_executor.cpu_decode_runner import half_groups
from sgl_kernel import cpu as cpu_kernels

ISAS = cpu_kernels.linear_wq_isas()
pytestmark = pytest.mark.skipif(
    not cpu_kernels.linear_wq_half_groups(),
    reason="sgl_kernel._cpu's linear_wq takes fp32 groups only",
)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "group"), [(576, 32), (1536, 32), (256, 64), (80, 16), (256, 256)])
@pytest.mark.parametrize("offsets", [True, False])
def test_fp16_groups_give_the_fp32_bits(isa, bits, k, group, offsets):
    # N: one 8-row chunk and a tail (61), a thread's runs of several chunks (1000), fewer than a chunk (5).
    for n in (5, 61, 1000):
        w = random_wq_weight(n, k, bits, group, offsets, seed=n, fp16_exact=True)
        half_offsets = None if w.offsets is None else w.offsets.half()
        bias = torch.randn(n)
        for m in (1, 2, 3, 5, 9):
            x = torch.randn(m, k)
            want = cpu_kernels.linear_wq(x, w.qweight, w.scales, w.offsets, bits, group, bias, isa=isa)
            got = cpu_kernels.linear_wq(
                x, w.qweight, w.scales.half(), half_offsets, bits, group, bias, isa=isa
            )
            assert torch.equal(got, want), (n, m, float((got - want).abs().max()))


def test_fp16_groups_differ_where_the_values_differ():
    # The widened values are used, not ignored: a scale that fp16 rounds gives other bits.
    w = random_wq_weight(16, 64, 4, 32, offsets=True, fp16_exact=True)
    scales = w.scales.clone()
    scales[3, 1] += 1e-7  # below fp16's resolution at this magnitude: the fp16 copy drops it
    x = torch.randn(1, 64)
    want = cpu_kernels.linear_wq(x, w.qweight, scales, w.offsets, 4, 32)
    got = cpu_kernels.linear_wq(x, w.qweight, scales.half(), w.offsets.half(), 4, 32)
    assert torch.equal(got[:, :3], want[:, :3]) and torch.equal(got[:, 4:], want[:, 4:])
    assert not torch.equal(got[:, 3], want[:, 3])


def test_half_groups_narrows_only_exact_values():
    w = random_wq_weight(8, 64, 4, 32, offsets=True, fp16_exact=True)
    s, o = half_groups(w.scales, w.offsets)
    assert s.dtype == o.dtype == torch.float16
    assert torch.equal(s.float(), w.scales) and torch.equal(o.float(), w.offsets)
    s, o = half_groups(w.scales, None)
    assert s.dtype == torch.float16 and o is None
    # One value fp16 cannot hold (an offset, or a scale) keeps both fp32: the kernel takes one dtype.
    inexact = w.offsets.clone()
    inexact[0, 0] = 1 / 3
    s, o = half_groups(w.scales, inexact)
    assert s is w.scales and o is inexact
    big = w.scales.clone()
    big[1, 1] = 1e6  # past fp16's range
    s, o = half_groups(big, w.offsets)
    assert s is big and o is w.offsets
