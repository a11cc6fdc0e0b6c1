"""What a few small host-side calls cost warm and right after a weight-sized stream.

    python benchmark/bench_cold_ops.py
    python benchmark/bench_cold_ops.py --stream-mb 300 --repeats 41

A decode step's host work (utils/host_tensors.py, docs/cpu_backend.md "Host work around a step")
runs right after the forward has read the model's weights through the caches. This times each
case below (thread CPU time, median of --repeats) twice: warm (the case run back to back) and
cold (after reading --stream-mb of fp32 through the caches, about what a decode step of the
built-in model reads). The cases are the per-step calls the host-work change replaced, beside
what replaced them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from radixserve.layers import sampler
from radixserve.utils.host_tensors import int64_tensor


def cases() -> dict[str, Callable[[], object]]:
    ids = [1234]
    logits = torch.randn(1, 49152)
    table = torch.zeros(64, 4096, dtype=torch.int32)
    host = table.numpy()
    rows, pos, loc = [3], [130], torch.tensor([777])
    out = {
        "torch.tensor(list)": lambda: torch.tensor(ids, dtype=torch.int64),
        "int64_tensor(list) (numpy)": lambda: int64_tensor(ids),
        "torch guard over argmax (11 ops)": lambda: sampler._guard(sampler.argmax(logits), logits, None),
        "table[rows, pos] = loc (torch)": lambda: table.__setitem__(
            (torch.tensor(rows), torch.tensor(pos)), loc.to(torch.int32)
        ),
        "table[rows, pos] = loc (numpy view)": lambda: host.__setitem__((rows, pos), loc.numpy()),
    }
    if getattr(sampler, "_CHECKED_KERNEL", False):
        out["argmax_rows_checked (1 call)"] = lambda: sampler.greedy_checked(logits)
    return out


def timed(fn: Callable[[], object], before: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        before()
        tic = time.thread_time()
        fn()
        times.append(time.thread_time() - tic)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stream-mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    stream = torch.ones(args.stream_mb * 2**20 // 4)
    scratch = np.zeros(1)

    def read_stream() -> None:
        scratch[0] = float(stream.sum())

    print(f"| call | warm us | after a {args.stream_mb} MB read, us |")
    print("|---|---:|---:|")
    for name, fn in cases().items():
        warm = timed(fn, lambda: None, args.repeats)
        cold = timed(fn, read_stream, args.repeats)
        print(f"| {name} | {warm * 1e6:.1f} | {cold * 1e6:.1f} |")


if __name__ == "__main__":
    main()
