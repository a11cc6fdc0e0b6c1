"""Random weight-only group-quantized weights of every form, shared by the linear_wq tests."""

from __future__ import annotations

import torch

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4


def random_wq_weight(
    n: int, k: int, bits: int, group: int, offsets: bool, seed: int = 0, fp16_exact: bool = False
) -> GroupQuantWeight:
    """An [n, k] weight: random integers (0..15 packed for bits 4, int8 for bits 8), scales of both
    signs (GGUF's fp16 d may be negative) and, with `offsets`, offsets around zero (Q4_1 / AWQ).
    `fp16_exact` rounds scales and offsets through fp16 (GGUF's d and m as stored), so fp16 copies
    of them hold every value exactly."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    else:
        qweight = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    groups = (n, k // group)
    scales = (torch.rand(groups, generator=gen) - 0.25) * 0.02
    off = (torch.rand(groups, generator=gen) - 0.5) * 0.1 if offsets else None
    if fp16_exact:
        scales = scales.half().float()
        off = None if off is None else off.half().float()
    return GroupQuantWeight(qweight, scales, off, group, bits)
