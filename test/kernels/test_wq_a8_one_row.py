"""The panel kernels' one-row path (wq_a8_one_row.h: what a decode step and an expert's single
pair take, with the weight stream prefetched) against the GEMM tiles (wq_a8_gemm.h, what 2 rows
and more take), bit for bit: a row's result does not depend on which path or tile computes it, so
each row of a 9-row product (a tile and its remainder) must equal the same row computed alone (and
in 2-4 row products). Every panel form (Q4_0's zero point, Q4_1's offsets,
Q8_0; fp16 and fp32 panels; groups of 32 and 128), with and without a bias, a last panel of 5
rows; the MoE one-call kernel at one token against the same token repeated 9 times."""

from __future__ import annotations

import pytest
import torch
from test_linear_wq_a8_packed import PANEL_ISAS, _x
from test_moe_wq_a8_packed import FORMS, _experts, _routing
from test_wq_a8_panel_bytes import _gguf_like, _pack

from radixserve.layers.group_quant import GroupQuantWeight
from radixserve.layers.moe.quantized import mark_int8_activations
from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.moe_wq_a8_packed_available(),
    reason="no AVX2 panel kernels in this build",
)

TILED_ROWS = 9  # two tiles of 5 and 4 rows (VNNI), three of 3 (AVX2: at most 4 a tile, evened out)


def _linear(
    x: torch.Tensor, w: GroupQuantWeight, packed: cpu_kernels.WqA8Packed, bias: torch.Tensor | None, isa: str
) -> torch.Tensor:
    args = (x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, bias)
    return cpu_kernels.linear_wq_a8(*args, isa=isa, packed=packed)


@pytest.mark.parametrize("isa", PANEL_ISAS)
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("fp32_panels", [False, True], ids=["file-bytes", "fp32"])
def test_one_row_equals_the_tiles(isa: str, kind: str, group: int, fp32_panels: bool) -> None:
    n, k = 37, 384  # a last panel of 5 rows, 12 blocks
    w = _gguf_like(n, k, kind, group, seed=group)
    packed = _pack(w, zero_point=0, dtype=torch.float32) if fp32_panels else _pack(w)
    x = _x(TILED_ROWS, k, seed=group)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(group))
    for b in (None, bias):
        tiled = _linear(x, w, packed, b, isa)  # [9, n]
        for rows in range(1, 5):
            for start in range(TILED_ROWS - rows + 1):
                got = _linear(x[start : start + rows], w, packed, b, isa)
                assert torch.equal(got, tiled[start : start + rows]), (rows, start)


@pytest.mark.parametrize("isa", PANEL_ISAS)
@pytest.mark.parametrize("form", list(FORMS))
def test_moe_one_token_equals_its_tiles(isa: str, form: str) -> None:
    """Every expert gets the token 9 times (tiles) or once (the one-row path): the same rows."""
    wq = mark_int8_activations(_experts(form, seed=3), panels=True)
    weights, ids = _routing(1, seed=3)
    x = _x(1, FORMS[form][0], seed=3)
    one = cpu_kernels.moe_wq_a8_packed(x, ids, weights, wq.w13_panels, wq.w2_panels, isa=isa)
    rep = (TILED_ROWS, 1)
    tiled = cpu_kernels.moe_wq_a8_packed(
        x.repeat(rep), ids.repeat(rep), weights.repeat(rep), wq.w13_panels, wq.w2_panels, isa=isa
    )
    assert torch.equal(tiled, one.expand(TILED_ROWS, -1))


@pytest.mark.parametrize("isa", PANEL_ISAS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_one_row_runs_split_across_threads(isa: str, kind: str) -> None:
    """Long enough that each of two threads gets its own run of panels (with the run's opening
    prefetches and the group streams' prefetches reaching past the end of some runs): the
    one-row path still equals the tiles row by row."""
    n, k = 1029, 576  # 129 panels, the last of 5 rows; groups of 32 (fp16 scales and offsets)
    w = _gguf_like(n, k, kind, 32, seed=5)
    packed = _pack(w)
    x = _x(TILED_ROWS, k, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tiled = _linear(x, w, packed, None, isa)
        for start in range(TILED_ROWS):
            got = _linear(x[start : start + 1], w, packed, None, isa)
            assert torch.equal(got, tiled[start : start + 1]), start
    finally:
        torch.set_num_threads(threads)
