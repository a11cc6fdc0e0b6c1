"""sgl-kernel's CPU extend (prefill) attention on one causal prompt, per KV pool dtype.

    python benchmark/bench_extend_attention.py                          # 2048 tokens, fp32 and bf16 pools
    python benchmark/bench_extend_attention.py --length 512 4096 --cpu-time

The built-in model's attention shape (9 query heads over 3 KV heads, head_dim 64), one request
whose whole prompt is new (no cached prefix), contiguous slots. Reported per layer: the kernel's
time (best of --repeats) and the causal work it stands for in GFLOP/s (4 x heads x head_dim x
L (L + 1) / 2: scores and values over the keys each query sees), so runs at different lengths
compare. --cpu-time: one thread timed by its CPU time, for a shared machine. Which tiles a bf16
pool runs (vdpbf16ps or fp32) is printed from sgl_kernel.cpu.extend_attention_bf16_dot().
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from sgl_kernel import cpu as cpu_kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_case(length: int, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One extend_attention call over a fresh pool holding one prompt of `length` tokens."""
    gen = torch.Generator().manual_seed(length)
    size = length + 1  # slot 0 stays unused, as in the server's pool
    k = torch.randn(size, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(size, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(length, NUM_HEADS, HEAD_DIM, generator=gen)
    r2t = torch.arange(1, size, dtype=torch.int32).view(1, length)
    rows, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([length])
    scale = HEAD_DIM**-0.5
    return lambda: cpu_kernels.extend_attention(q, k, v, r2t, rows, lens, lens, scale)


def best_seconds(step: Callable[[], torch.Tensor], repeats: int, clock: Callable[[], float]) -> float:
    step()  # warm-up: the per-thread tile buffers grow on first use
    best = float("inf")
    for _ in range(repeats):
        tic = clock()
        step()
        best = min(best, clock() - tic)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, nargs="+", default=[2048])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    args = parser.parse_args(argv)
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)  # at::parallel_for then runs inline, in the timed thread
        clock = time.thread_time
    # Builds from before the vdpbf16ps tiles lack the query: they run fp32 tiles on bf16 pools.
    bf16_dot = getattr(cpu_kernels, "extend_attention_bf16_dot", lambda: False)()
    tiles = "vdpbf16ps" if bf16_dot else "fp32"
    print(
        f"threads {torch.get_num_threads()}, isa {cpu_kernels.extend_attention_isa()}, bf16 pools: {tiles} tiles"
    )
    print(f"{'length':>6} {'dtype':>5} {'ms/layer':>9} {'GFLOP/s':>8}")
    for length in args.length:
        flops = 4 * NUM_HEADS * HEAD_DIM * length * (length + 1) / 2
        for name in args.dtype:
            seconds = best_seconds(make_case(length, DTYPES[name]), args.repeats, clock)
            print(f"{length:>6} {name:>5} {1e3 * seconds:>9.1f} {flops / seconds / 1e9:>8.1f}")


if __name__ == "__main__":
    main()
