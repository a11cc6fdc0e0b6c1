"""sgl-kernel's CPU decode attention against a plain read of the same K/V bytes, per KV dtype.

    python benchmark/bench_decode_attention.py                       # 16/64 requests x 128/2048 tokens
    python benchmark/bench_decode_attention.py --batch-size 16 --context 2048 --dtype bf16

The built-in model's attention shape (9 query heads over 3 KV heads, head_dim 64). Each case builds
enough layers of a KV pool that one pass over them exceeds the last-level cache (as a decode step
over 30 layers does), with each request's slots a contiguous run (a fresh pool's allocation;
--scattered: a random permutation, as after churn). Reported per layer: the kernel's time, the
time of a plain streaming read of the same number of K/V bytes (a torch sum over a contiguous
buffer of that size, both threads), and the kernel's share of that bound (read / kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sgl_kernel import cpu as cpu_kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
MIN_PASS_BYTES = 256 << 20  # a pass over the layers' K/V of at least this many bytes leaves the L3


def median_ms(step: Callable[[], None], repeats: int, clock: Callable[[], float]) -> float:
    step()
    times = []
    for _ in range(repeats):
        tic = clock()
        step()
        times.append(clock() - tic)
    return 1e3 * statistics.median(times)


def make_pool(
    bs: int, ctx: int, dtype: torch.dtype, scattered: bool
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """K and V of one layer [size, Hkv, D] in `dtype`, req_to_token [bs, ctx] int32, scale kwargs."""
    size = bs * ctx + 1
    k = torch.randn(size, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(size, NUM_KV_HEADS, HEAD_DIM)
    kwargs = {}
    if dtype == torch.int8:
        scale = torch.full((size, NUM_KV_HEADS), 1 / 32)
        k, v = (x.mul(32).round().clamp(-127, 127).to(torch.int8) for x in (k, v))
        kwargs = {"k_scale": scale, "v_scale": scale.clone()}
    else:
        k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(size - 1) + 1 if scattered else torch.arange(1, size)
    return k, v, {"r2t": slots.int().view(bs, ctx).contiguous(), **kwargs}


def bench_case(
    bs: int, ctx: int, dtype: torch.dtype, scattered: bool, repeats: int, clock: Callable[[], float]
) -> tuple[float, float, float]:
    """(kernel ms per layer, plain read ms per layer, MB of K/V per layer)."""
    bytes_per_layer = 2 * bs * ctx * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = max(2, -(-MIN_PASS_BYTES // bytes_per_layer))
    pools = [make_pool(bs, ctx, dtype, scattered) for _ in range(layers)]
    q = torch.randn(bs, NUM_HEADS, HEAD_DIM)
    rows, lens = torch.arange(bs), torch.full((bs,), ctx)

    def kernel() -> None:
        for k, v, extra in pools:
            r2t = extra["r2t"]
            scales = {n: t for n, t in extra.items() if n != "r2t"}
            cpu_kernels.decode_attention(q, k, v, r2t, rows, lens, HEAD_DIM**-0.5, **scales)

    # The same bytes as one contiguous fp32 buffer per layer: what the memory system gives a
    # streaming reader (the bound the kernel is measured against).
    flat = [torch.randn(bytes_per_layer // 4) for _ in range(layers)]

    def plain_read() -> None:
        for x in flat:
            x.sum()

    kernel_ms, read_ms = (median_ms(f, repeats, clock) / layers for f in (kernel, plain_read))
    return kernel_ms, read_ms, bytes_per_layer / 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--scattered", action="store_true", help="random slots instead of contiguous runs")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its CPU time: on a shared machine, immune to the time other processes take",
    )
    args = parser.parse_args(argv)
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)  # at::parallel_for then runs inline, in the timed thread
        clock = time.thread_time
    clock_name = "thread CPU time" if args.cpu_time else "wall"
    print(
        f"threads {torch.get_num_threads()}, {clock_name}, slots {'scattered' if args.scattered else 'contiguous'}"
    )
    print(
        f"{'batch':>5} {'context':>7} {'dtype':>8} {'MB/layer':>9} {'kernel ms':>10} {'read ms':>8} {'read/kernel':>11}"
    )
    for bs in args.batch_size:
        for ctx in args.context:
            for name in args.dtype:
                kernel, read, mb = bench_case(bs, ctx, DTYPES[name], args.scattered, args.repeats, clock)
                print(
                    f"{bs:>5} {ctx:>7} {name:>8} {mb:>9.1f} {kernel:>10.3f} {read:>8.3f} {read / kernel:>11.2f}"
                )


if __name__ == "__main__":
    main()
