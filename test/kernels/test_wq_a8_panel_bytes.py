"""The int8-activation panels at the file's bytes: pack_wq_a8 stores GGUF-like scales (and Q4_1's
offsets) as fp16 and drops Q4_0's offsets (-8 * scale, formed from the scales in the kernel), so
a row-block of 32 inputs is 18 (Q4_0), 20 (Q4_1) or 34 (Q8_0) bytes. The products on those panels
equal, bit for bit, the same kernels on the fp32 panels with the offsets stored (and so the
reference, test_linear_wq_a8_packed.py / test_moe_wq_a8_packed.py); scales that fp16 would round
keep fp32; the kernels refuse inconsistent panels."""

from __future__ import annotations

import pytest
import torch
from test_linear_wq_a8 import _check  # the int8-activation reference, with its fp32 tolerance
from test_linear_wq_a8_packed import PANEL_ISAS, _x

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.layers.moe.quantized import ExpertsWq, mark_int8_activations
from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.moe_wq_a8_packed_available(),
    reason="no AVX2 panel kernels in this build",
)


def _gguf_like(n: int, k: int, kind: str, group: int = 32, seed: int = 0) -> GroupQuantWeight:
    """Q4_0 (offsets -8 d), Q4_1 (fp16 offsets m) or Q8_0 as gguf_quant.py makes the forms: fp16
    scales of both signs, widened to fp32."""
    gen = torch.Generator().manual_seed(seed)
    groups = (n, k // group)
    scales = ((torch.rand(groups, generator=gen) - 0.25) * 0.02).half().float()
    if kind == "q8_0":
        q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
        return GroupQuantWeight(q, scales, None, group, 8)
    q = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    if kind == "q4_0":
        return GroupQuantWeight(q, scales, scales * -8.0, group, 4)
    offsets = ((torch.rand(groups, generator=gen) - 0.5) * 0.1).half().float()
    return GroupQuantWeight(q, scales, offsets, group, 4)


def _pack(w: GroupQuantWeight, **kw: object) -> cpu_kernels.WqA8Packed:
    return cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, w.bits, w.group_size, **kw)


@pytest.mark.parametrize(
    ("kind", "zero", "offsets", "row_block"),
    [("q4_0", 8, False, 18), ("q4_1", 0, True, 20), ("q8_0", 0, False, 34)],
)
def test_panels_hold_the_files_bytes(kind: str, zero: int, offsets: bool, row_block: int) -> None:
    n, k = 16, 128
    w = _gguf_like(n, k, kind)
    p = _pack(w)
    assert p.scales.dtype == torch.float16 and p.zero_point == zero and (p.offsets is not None) == offsets
    assert p.nbytes() == n * (k // 32) * row_block
    # The fp16 panels widen back to the form's scales and offsets exactly.
    assert torch.equal(p.scales.float().transpose(1, 2).reshape(n, -1), w.scales)
    if offsets:
        assert torch.equal(p.offsets.float().transpose(1, 2).reshape(n, -1), w.offsets)


def test_scales_fp16_would_round_stay_fp32() -> None:
    """Q4_K-like scales (d times a 6-bit integer) or any fp32 scale: fp16 would change them."""
    w = _gguf_like(8, 64, "q4_0")
    w = GroupQuantWeight(w.qweight, w.scales * (1 + 2.0**-20), w.offsets, 32, 4)  # offsets no longer -8 s
    p = _pack(w)
    assert p.scales.dtype == torch.float32 and p.zero_point == 0 and p.offsets is not None
    assert p.offsets.dtype == torch.float32


@pytest.mark.parametrize("isa", PANEL_ISAS)
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("m", [1, 3, 4, 17])
def test_file_byte_panels_give_the_fp32_panels_bits(isa: str, kind: str, group: int, m: int) -> None:
    n, k = 37, 384  # a last panel of 5 rows, 12 blocks
    w = _gguf_like(n, k, kind, group, seed=m)
    x = _x(m, k, seed=m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m)) if m % 2 else None
    small = _pack(w)
    full = _pack(w, zero_point=0, dtype=torch.float32)
    assert full.nbytes() > small.nbytes()
    args = (x, w.qweight, w.scales, w.offsets, w.bits, group, bias)
    got = cpu_kernels.linear_wq_a8(*args, isa=isa, packed=small)
    assert torch.equal(got, cpu_kernels.linear_wq_a8(*args, isa=isa, packed=full))
    # Every path the same bits (VNNI's int32 block dots are AVX2's).
    assert torch.equal(got, cpu_kernels.linear_wq_a8(*args, packed=full))
    _check(got, x, w, bias)


@pytest.mark.parametrize("isa", PANEL_ISAS)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_on_file_byte_panels(isa: str, tokens: int) -> None:
    """Q4_0 gate/up and Q8_0 down experts, stacked at the file's bytes: the one-call kernel's
    numbers are those of the same experts on fp32 panels with Q4_0's offsets stored."""
    hidden, inter, experts, top_k = 96, 64, 5, 3
    w13 = tuple(_gguf_like(2 * inter, hidden, "q4_0", seed=e) for e in range(experts))
    w2 = tuple(_gguf_like(hidden, inter, "q8_0", seed=50 + e) for e in range(experts))
    wq = mark_int8_activations(ExpertsWq(w13, w2), panels=True)
    assert wq.w13_panels.zero_point == 8 and wq.w13_panels.offsets is None
    assert wq.w13_panels.scales.dtype == wq.w2_panels.scales.dtype == torch.float16
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    got = cpu_kernels.moe_wq_a8_packed(x, ids, weights, wq.w13_panels, wq.w2_panels, isa=isa)
    want = cpu_kernels.moe_wq_a8_packed(x, ids, weights, _fp32_panels(w13), _fp32_panels(w2), isa=isa)
    assert torch.equal(got, want)
    assert torch.equal(got, cpu_kernels.moe_wq_a8_packed(x, ids, weights, wq.w13_panels, wq.w2_panels))


def _fp32_panels(forms: tuple[GroupQuantWeight, ...]) -> cpu_kernels.WqA8PackedExperts:
    """Every expert's panels as before fp16 and zero points: fp32 scales, offsets stored."""
    alone = [_pack(f, zero_point=0, dtype=torch.float32) for f in forms]
    offsets = None if alone[0].offsets is None else torch.stack([a.offsets for a in alone])
    return cpu_kernels.WqA8PackedExperts(
        torch.stack([a.q for a in alone]),
        torch.stack([a.scales for a in alone]),
        offsets,
        alone[0].n,
        alone[0].bits,
        alone[0].group_size,
    )


def test_experts_share_one_zero_point_and_dtype() -> None:
    """One expert whose offsets are not -8 * scale: every expert keeps its offsets stored."""
    forms = [_gguf_like(16, 64, "q4_0", seed=e) for e in range(3)]
    odd = _gguf_like(16, 64, "q4_1", seed=9)
    parts = [(f.qweight, f.scales, f.offsets) for f in (*forms, odd)]
    packed = cpu_kernels.pack_wq_a8_experts(parts, 4, 32)
    assert packed.zero_point == 0 and packed.offsets is not None
    assert packed.scales.dtype == packed.offsets.dtype == torch.float16


def test_refusals() -> None:
    w = _gguf_like(16, 64, "q4_1")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="not -8 \\* scale"):
        _pack(w, zero_point=8)
    p = _pack(w)
    with pytest.raises(RuntimeError, match="zero_point 8 needs int4 panels without offsets"):
        cpu_kernels._lib().linear_wq_a8_packed(x, p.q, p.scales, p.offsets, 16, 4, 32, None, 8)
    with pytest.raises(RuntimeError, match="packed offsets must be a contiguous Half"):
        cpu_kernels._lib().linear_wq_a8_packed(x, p.q, p.scales, p.offsets.float(), 16, 4, 32, None, 0)
    with pytest.raises(RuntimeError, match="packed scales must be float32 or float16"):
        cpu_kernels._lib().linear_wq_a8_packed(x, p.q, p.scales.double(), None, 16, 4, 32, None, 0)
    q8 = _pack(_gguf_like(16, 64, "q8_0"))
    with pytest.raises(RuntimeError, match="needs int4 panels"):
        cpu_kernels._lib().linear_wq_a8_packed(x, q8.q, q8.scales, None, 16, 8, 32, None, 8)
