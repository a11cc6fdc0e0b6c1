"""The greedy sampler's argmax: sgl-kernel's argmax_rows against torch.argmax(dim=-1), one thread,
thread CPU time, on the vocabularies served here (the built-in model's 49,152, Qwen3's 151,936).

    python benchmark/bench_argmax.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from sgl_kernel import cpu as cpu_kernels

SHAPES = ((1, 151936), (1, 49152), (16, 49152), (64, 49152))


def _us(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for rows, n in SHAPES:
        x = torch.randn(rows, n)
        ours = _us(lambda x=x: cpu_kernels.argmax_rows(x), args.calls)
        ref = _us(lambda x=x: x.argmax(dim=-1), args.calls)
        print(f"[{rows}, {n}]: torch.argmax {ref:8.1f} us, argmax_rows {ours:7.1f} us ({ref / ours:.1f}x)")


if __name__ == "__main__":
    main()
