"""linear_wq_a8 on pack_wq_a8 panels at batch sizes (sgl-kernel's wq_a8_gemm.h: the GEMM tiles,
on VNNI or on AVX2's vpmaddubsw sums, and the threaded quantizer serve products of 2 rows and
more) against its references:

- each row's result is the same bits whether it runs alone (the one-row / panel path) or inside a
  batch of any size (whatever tile, remainder tile or row chunk it falls in);
- the VNNI batch equals the AVX2 batch's bits (the same int32 block dots, the same fp32 epilogue);
- it equals linear_wq_a8_reference within test_linear_wq_a8's bound.

Random shapes with ragged tails: M past the 6-row tiles and the 128-row chunks, N not a multiple
of the 16-row panel pairs (an odd last panel, a part-filled one), K of an odd number of blocks;
Q4_0 (zero point, offsets formed), Q4_1 (stored offsets), Q8_0; fp16 and fp32 packed scales.
Each case runs on every tile path compiled in and present on this CPU (avx2 on every x86 build;
avx512 skips with the reason where VNNI is missing)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_linear_wq import _weight  # the same random group-quantized weights
from test_linear_wq_a8 import _check  # the int8-activation reference and its tolerance

from radixserve.layers.group_quant import GroupQuantWeight
from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.linear_wq_a8_packed_available(),
    reason="no AVX2 panel kernel for linear_wq_a8 in this build",
)

ISAS = [
    pytest.param(
        isa,
        marks=pytest.mark.skipif(
            isa not in cpu_kernels.linear_wq_a8_isas(), reason=f"no {isa} path built, or not on this CPU"
        ),
    )
    for isa in ("avx512", "avx2")
]


def _run(
    x: torch.Tensor,
    w: GroupQuantWeight,
    bias: torch.Tensor | None = None,
    isa: str = "auto",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    packed = cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, w.bits, w.group_size, dtype=dtype)
    return cpu_kernels.linear_wq_a8(
        x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, bias, isa=isa, packed=packed
    )


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    """Blocks of very different magnitudes, one all zero, and values on the rounding midpoints."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(m, k // 32, 1, generator=gen).repeat(1, 1, 32).view(m, k)
    x = torch.randn(m, k, generator=gen) * scale
    x[0, :32] = 0.0
    if m > 1 and k >= 64:
        # amax 127 makes the int8 step 1: x = j + 0.5 rounds half to even, both ways.
        x[1, 32:64] = torch.arange(32, dtype=torch.float32) - 15.5
        x[1, 63] = 127.0
    return x


def _form(n: int, k: int, kind: str, seed: int) -> GroupQuantWeight:
    """GGUF-like forms: Q4_0 (offsets -8 * scale), Q4_1 (offsets of their own), Q8_0, in groups of
    32 (and Q4_1 in groups of 64, as torchao's)."""
    if kind == "Q4_0":
        w = _weight(n, k, 4, 32, offsets=False, seed=seed)
        scales = w.scales.half().float()
        return GroupQuantWeight(w.qweight, scales, scales * -8.0, 32, 4)
    group = 64 if kind == "Q4_1g64" and k % 64 == 0 else 32  # K of an odd block count: 32
    bits = 8 if kind == "Q8_0" else 4
    w = _weight(n, k, bits, group, offsets=bits == 4, seed=seed)
    offsets = None if w.offsets is None else w.offsets.half().float()
    return GroupQuantWeight(w.qweight, w.scales.half().float(), offsets, group, bits)


KINDS = ["Q4_0", "Q4_1", "Q4_1g64", "Q8_0"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "m, n, k",
    [
        (5, 24, 96),
        (8, 16, 64),
        (9, 8, 64),
        (13, 23, 96),
        (16, 40, 384),
        (31, 1, 192),
        (64, 72, 576),
        (133, 57, 320),
    ],
)
def test_rows_alone_and_in_a_batch_are_the_same_bits(kind: str, m: int, n: int, k: int, isa: str) -> None:
    w = _form(n, k, kind, seed=m + n)
    x = _x(m, k, seed=k + m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)) if m % 2 else None
    got = _run(x, w, bias, isa)
    alone = torch.cat([_run(x[i : i + 1], w, bias, isa) for i in range(m)])
    assert torch.equal(got, alone)
    # Any cut of the batch: a row's tile neighbours do not move its bits.
    cut = 7 if m > 7 else 1
    assert torch.equal(got, torch.cat([_run(x[:cut], w, bias, isa), _run(x[cut:], w, bias, isa)]))
    if isa == "avx512" and "avx2" in cpu_kernels.linear_wq_a8_isas():
        assert torch.equal(got, _run(x, w, bias, "avx2"))
    _check(got, x, w, bias)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_past_one_row_chunk(kind: str, isa: str) -> None:
    """300 rows: two full 128-row chunks and a ragged third, each ending in a part tile."""
    n, k, m = 45, 128, 300
    w = _form(n, k, kind, seed=3)
    x = _x(m, k, seed=4)
    got = _run(x, w, None, isa)
    alone = torch.cat([_run(x[i : i + 4], w, None, isa) for i in range(0, m, 4)])
    assert torch.equal(got, alone)
    _check(got, x, w, None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_fp32_and_fp16_scales_give_the_same_bits(kind: str, isa: str) -> None:
    n, k, m = 24, 192, 20
    w = _form(n, k, kind, seed=5)
    x = _x(m, k, seed=6)
    assert torch.equal(_run(x, w, None, isa, torch.float32), _run(x, w, None, isa, torch.float16))


@pytest.mark.parametrize("isa", ISAS)
def test_strided_rows_and_threads(isa: str) -> None:
    """x a view with a row stride past K (a slice of a wider buffer), and one thread against the
    default: the quantizer's and the tiles' split over threads does not move a bit."""
    n, k, m = 40, 256, 37
    w = _form(n, k, "Q4_1", seed=7)
    wide = _x(m, k + 64, seed=8)
    x = wide[:, :k]
    got = _run(x, w, None, isa)
    assert torch.equal(got, _run(x.contiguous(), w, None, isa))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(got, _run(x, w, None, isa))
    finally:
        torch.set_num_threads(threads)


def test_auto_batches_match_the_reference() -> None:
    """Whatever path this CPU takes for a batch (GEMM tiles with VNNI, else the panels)."""
    for kind in KINDS:
        w = _form(33, 160, kind, seed=9)
        x = _x(40, 160, seed=10)
        _check(_run(x, w), x, w, None)


def _with_threads(threads: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("m", [3, 16, 64])
def test_batches_the_threads_pull_are_the_same_bits(isa: str, m: int) -> None:
    """Decode-sized batches (one row chunk) run in panel runs the threads pull from a counter
    (wq_a8_gemm.h's parallel_chunks): one thread, two, and three (more tasks taken by fewer cores
    than threads) give the bits of each row alone, at the built-in model's K (576) and an N of an
    odd panel count (65 panels, ~33 pairs: several runs a thread)."""
    if isa not in cpu_kernels.linear_wq_a8_isas():
        pytest.skip(f"no {isa} path in this build")
    n, k = 520, 576
    w = _form(n, k, "Q4_1", seed=13)
    x = _x(m, k, seed=14)
    got = _with_threads(2, lambda: _run(x, w, None, isa))
    for threads in (1, 3):
        assert torch.equal(got, _with_threads(threads, lambda: _run(x, w, None, isa)))
    assert torch.equal(got, torch.cat([_run(x[i : i + 1], w, None, isa) for i in range(m)]))
    _check(got, x, w, None)


@pytest.mark.parametrize("isa", ISAS)
def test_quantizer_on_threads_past_the_inline_bound(isa: str) -> None:
    """150 rows of K 1536 (230,400 elements, past kInlineQuantElems): x quantized on every thread,
    the tiles in one contiguous run a thread (past one row chunk); the bits of 4-row batches,
    whose x is quantized inline."""
    n, k, m = 40, 1536, 150
    w = _form(n, k, "Q8_0", seed=15)
    x = _x(m, k, seed=16)
    got = _run(x, w, None, isa)
    assert torch.equal(got, torch.cat([_run(x[i : i + 4], w, None, isa) for i in range(0, m, 4)]))
    _check(got, x, w, None)
