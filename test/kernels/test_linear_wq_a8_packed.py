"""sgl-kernel's linear_wq_a8 on weights repacked into panels of 8 output rows (pack_wq_a8, the
panel kernel on each of its paths: AVX2, and AVX-512 VNNI where built) against radixserve.layers.group_quant.linear_wq_a8_reference: every weight form
(int4 / int8, with and without offsets, group sizes 32-128), row counts through the kernel's
4-row tiles and their rests, output counts not a multiple of the 8-row panel, K of an odd number
of blocks; the int16 sums at their largest; the lossless re-layout; the forms that carry it."""

from __future__ import annotations

import pytest
import torch
from test_linear_wq import _weight  # the same random group-quantized weights
from test_linear_wq_a8 import _check, isa_params  # the int8-activation reference, its tolerance

from radixserve.layers import group_quant
from radixserve.layers.cpu_crossovers import active as crossovers
from radixserve.layers.group_quant import GroupQuantWeight, pack_int4, with_int8_activations
from radixserve.layers.linear import Linear, linear, onednn_prepack_available, prepare_cpu_linears
from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.linear_wq_a8_packed_available(),
    reason="no AVX2 panel kernel for linear_wq_a8 in this build",
)


# The panel kernel's paths ("scalar" has none).
PANEL_ISAS = isa_params(("avx2", "avx512"))


def _run(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None, isa: str = "auto"
) -> torch.Tensor:
    packed = cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, w.bits, w.group_size)
    return cpu_kernels.linear_wq_a8(
        x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, bias, isa=isa, packed=packed
    )


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    """Blocks of very different magnitudes (each block's own int8 scale matters), one all zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k // 32, 1, generator=gen).repeat(1, 1, 32).view(
        m, k
    )
    x[0, :32] = 0.0
    return x


@pytest.mark.parametrize("isa", PANEL_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offsets", [False, True], ids=["sym", "offsets"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 17, 130])
def test_matches_the_reference(isa: str, bits: int, offsets: bool, group: int, m: int) -> None:
    n, k = 37, 384  # 37: four full panels and one of 5 rows; 384: 12 blocks
    w = _weight(n, k, bits, group, offsets, seed=bits + group + m)
    x = _x(m, k, seed=m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m)) if m % 2 else None
    got = _run(x, w, bias, isa)
    _check(got, x, w, bias)
    if isa != "avx2" and "avx2" in cpu_kernels.linear_wq_a8_isas():
        # The VNNI block dots are the AVX2 ones' int32s, and the fp32 epilogue is shared.
        assert torch.equal(got, _run(x, w, bias, "avx2"))


@pytest.mark.parametrize("isa", PANEL_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [1, 8, 9, 23])
def test_odd_shapes(isa: str, bits: int, n: int) -> None:
    """K of 3 blocks (an odd count) and panels with 1-7 live rows."""
    w = _weight(n, 96, bits, 32, offsets=bits == 4, seed=n)
    x = _x(6, 96, seed=n)
    _check(_run(x, w, isa=isa), x, w, None)


@pytest.mark.parametrize("isa", PANEL_ISAS)
def test_int4_int16_sums_at_their_largest(isa: str) -> None:
    """Every nibble 15 against x at +127 in every byte: a block's 8 vpmaddubsw results add up in
    int16 to 8 * 2 * 15 * 127 = 30480 per lane; an overflow would flip the sign."""
    n, k = 8, 128
    w = GroupQuantWeight(pack_int4(torch.full((n, k), 15)), torch.ones(n, k // 32), None, 32, 4)
    x = torch.full((3, k), 127.0)  # activation scale exactly 1
    x[1] = -127.0
    got = _run(x, w, isa=isa)
    expect = torch.tensor([1.0, -1.0, 1.0]).unsqueeze(1).expand(3, n) * (15 * 127 * k)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("isa", PANEL_ISAS)
def test_int8_panels_at_the_extremes(isa: str) -> None:
    """int8 weights -128 and 127 against x at +-127: VNNI reads them as 0 and 255 and starts each
    lane at -128 * the block's sum(x), AVX2 as |w| = 128 against x * sign(w); exact either way."""
    n, k = 9, 96
    q = torch.where(torch.arange(n * k).view(n, k) % 3 == 0, 127, -128).to(torch.int8)
    w = GroupQuantWeight(q, torch.ones(n, k // 32), None, 32, 8)
    x = torch.full((5, k), 127.0)
    x[1] = -127.0
    x[2, ::2] = -127.0
    x[3, :32] = 0.0  # a zero block: scale 0, sum 0
    got = _run(x, w, isa=isa)
    assert torch.equal(got, x @ q.float().T)


@pytest.mark.parametrize("isa", PANEL_ISAS)
def test_x_is_quantized_as_the_reference_at_every_row_count(isa: str) -> None:
    """One row (the one-row loop), a few rows (the tiles) and the canonical-row kernel quantize x
    to the same bytes as group_quant.quantize_act_blocks: against a one-hot int8 weight (row i has
    a single 1 at input i, scale 1) each output is one block's int8 value times its scale, one fp32
    product, so it must equal the reference's dequantized x bit for bit (ties at .5 included). The
    int4 forms' offsets add a group term whose cancellation is not exact, so int8 carries this."""
    k = 96
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3)) * torch.tensor([1.0, 1e-3, 50.0]).view(
        3, 1
    )
    x[0, :32] = 0.0  # an all-zero block
    # amax 127: x * (127 / amax) is x itself, so the halves are ties (round half to even: 2.5 -> 2)
    x[1, 32:64] = torch.cat([torch.tensor([127.0, -127.0]), torch.arange(30) - 14.5])
    w = GroupQuantWeight(torch.eye(k, dtype=torch.int8), torch.ones(k, k // 32), None, 32, 8)
    expect = group_quant.quantize_act_blocks(x)
    assert torch.equal(_run(x, w, isa=isa), expect)  # 3 rows: the tiles
    for i in range(3):
        assert torch.equal(_run(x[i : i + 1], w, isa=isa), expect[i : i + 1])  # one row
    canonical = cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None)
    assert torch.equal(canonical, expect)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_is_a_lossless_relayout(bits: int) -> None:
    """The panel bytes and scales are the canonical ones moved (rows past N zero)."""
    n, k = 11, 64
    w = _weight(n, k, bits, 32, offsets=True, seed=2)
    p = cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, bits, 32)
    chunks = 4 if bits == 4 else 8
    # [P, blocks, chunk, row, 4] -> [rows, blocks * chunk * 4]: the canonical row bytes
    rows = p.q.view(2, k // 32, chunks, 8, 4).permute(0, 3, 1, 2, 4).reshape(16, -1)
    assert torch.equal(rows[:n], w.qweight) and not rows[n:].any()
    assert torch.equal(p.scales.transpose(1, 2).reshape(16, -1)[:n], w.scales)
    assert torch.equal(p.offsets.transpose(1, 2).reshape(16, -1)[:n], w.offsets)
    assert p.nbytes() == 16 * (w.qweight.shape[1] + 2 * 4 * (k // 32))


def test_refusals() -> None:
    w = _weight(16, 64, 4, 32, offsets=False)
    packed = cpu_kernels.pack_wq_a8(w.qweight, w.scales, None, 4, 32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="scalar"):
        cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, None, 4, 32, isa="scalar", packed=packed)
    with pytest.raises(RuntimeError, match="packed_q"):
        cpu_kernels.linear_wq_a8(torch.randn(2, 128), w.qweight, w.scales, None, 4, 32, packed=packed)
    with pytest.raises(RuntimeError, match="linear_wq_a8_packed: bias must be a contiguous float32"):
        cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, None, 4, 32, torch.randn(15), packed=packed)
    with pytest.raises(ValueError, match="not packable"):
        cpu_kernels.pack_wq_a8(w.qweight, w.scales.repeat(1, 2), None, 4, 16)


def test_marked_forms_carry_and_use_the_packed_weight() -> None:
    w = _weight(24, 128, 4, 32, offsets=True, seed=7)
    marked = with_int8_activations(w, panels=True)
    assert marked.int8_activations and marked.a8_packed is not None
    # Without panels (the default marking: no second copy) the form carries none.
    assert with_int8_activations(w).a8_packed is None
    # Every row count takes the panels (a prefill's 130 rows too), an unmarked form none.
    for m in (3, 16, 130):
        x = _x(m, 128, seed=8 + m)
        _check(group_quant.linear_wq(x, marked), x, w, None)
        assert not torch.equal(group_quant.linear_wq(x, marked), group_quant.linear_wq(x, w))


def test_linear_reads_panel_forms_at_every_batch_size() -> None:
    """layers/linear.py's linear(): a form with panels is read at every batch size (the
    int8-activation product, not the fp32 weight's), other forms up to wq_max_tokens."""
    w = _weight(16, 64, 4, 32, offsets=False, seed=4)
    marked = with_int8_activations(w, panels=True)
    fp32 = w.dequantize()
    bound = crossovers().wq_max_tokens
    for rows in (bound + 1, 16, 130):
        x = _x(rows, 64, seed=9 + rows)
        _check(linear(x, fp32, weight_wq=marked), x, w, None)
    assert group_quant.wq_rows_bound(w, bound) == bound
    more = _x(bound + 1, 64, seed=10)
    assert torch.equal(linear(more, fp32, weight_wq=w), linear(more, fp32))


def test_panel_forms_get_no_onednn_copy() -> None:
    """prepare_cpu_linears leaves a Linear whose form has panels without the oneDNN copy it never
    reads; other Linears get theirs."""
    if not onednn_prepack_available():
        pytest.skip("this torch build has no oneDNN prepacking")
    layers = [Linear(64, 16), Linear(64, 16)]
    for layer in layers:
        layer.weight.data.copy_(_weight(16, 64, 4, 32, offsets=False, seed=5).dequantize())
    layers[0].weight_wq = with_int8_activations(_weight(16, 64, 4, 32, offsets=False, seed=5), panels=True)
    prepare_cpu_linears(layers, fp16=False, prepack=True)
    assert layers[0].weight_packed is None and layers[1].weight_packed is not None
