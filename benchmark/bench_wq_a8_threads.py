"""One int8-activation batch GEMM (linear_wq_a8 on pack_wq_a8 panels, Q4_1) at the built-in
model's decode shapes on two threads, wall time, the least disturbed of many calls: what a
parallel region's start costs when the OpenMP worker slept since the last one.

    python benchmark/bench_wq_a8_threads.py                        # the served spin (10 us)
    GOMP_SPINCOUNT=300000 python benchmark/bench_wq_a8_threads.py  # GNU OpenMP's default spin

radixserve is imported before torch so the process runs the spin the server's scheduler runs
(utils/cpus.py), unless GOMP_SPINCOUNT is set. Calls follow each other with only Python between
them (as a decode step's linears do, with less in between). The minimum and the first quartile of
--repeats calls are printed: on a shared machine the minimum is what the load disturbs least.
"""

from __future__ import annotations

import argparse
import os
import time

import radixserve  # noqa: F401

# isort: split
import torch

from radixserve.layers.group_quant import GroupQuantWeight
from sgl_kernel import cpu as cpu_kernels

SHAPES = ((16, 1536, 576), (16, 576, 1536), (64, 1536, 576), (2048, 1536, 576))  # (M, N, K)


def _q4_1(n: int, k: int) -> GroupQuantWeight:
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    offsets = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    return GroupQuantWeight(q[:, 0::2] | (q[:, 1::2] << 4), scales, offsets, 32, 4)


def time_shape(m: int, n: int, k: int, repeats: int) -> tuple[float, float]:
    """(min, first quartile) microseconds a call."""
    w = _q4_1(n, k)
    packed = cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, w.bits, w.group_size)
    x = torch.randn(m, k)
    times = []
    for i in range(repeats + 5):  # 5 warm-up calls
        start = time.perf_counter()
        cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, w.offsets, 4, 32, None, packed=packed)
        if i >= 5:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[0] * 1e6, times[len(times) // 4] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300, help="calls a shape (a tenth for M > 1000)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, {args.threads} threads, {cpu_kernels.__file__}"
    )
    for m, n, k in SHAPES:
        lo, q1 = time_shape(m, n, k, args.repeats if m <= 1000 else max(5, args.repeats // 10))
        print(f"M={m} N={n} K={k}: min {lo:.0f} us, first quartile {q1:.0f} us")


if __name__ == "__main__":
    main()
