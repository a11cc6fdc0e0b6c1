"""Per-call latency of tensor parallelism's collectives on one host: gloo against the shared-memory
communicator (radixserve.distributed.shm_comm), at SmolLM2-135M's shapes.

    python benchmark/bench_all_reduce.py                  # 2 ranks on CPUs 0 and 1
    python benchmark/bench_all_reduce.py --world 2 --cpus 2 3 --iters 1000

Each rank is a spawned process pinned to its own CPU with one torch thread (the issue's "each rank
gets its share of the cores, pinned"), joined by a gloo group on 127.0.0.1. all_reduce: an fp32
[rows, 576] SUM in place (a row-parallel o_proj / down_proj output, rows = tokens in the batch).
all_gather: [rows, n] -> [rows, world * n] along the last dim (gloo: all_gather + cat, as a
vocab-parallel LM head does it; n = 24576 is half of the 49,152-token vocab). Calls run back to
back, each timed on its own on rank 0, after a warm-up; the table gives the median and the 90th
percentile in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from radixserve.testing.ranks import collect_from_ranks

HIDDEN, HALF_VOCAB = 576, 24576
REDUCE_SHAPES = [(1, HIDDEN), (2, HIDDEN), (16, HIDDEN), (64, HIDDEN), (256, HIDDEN), (2048, HIDDEN)]
GATHER_SHAPES = [*REDUCE_SHAPES, (1, HALF_VOCAB), (16, HALF_VOCAB)]
WARMUP = 50


def iterations(numel: int, fixed: int | None) -> int:
    """The same count on every rank (they must make the same calls): ~1 GB moved per size."""
    return fixed if fixed is not None else max(200, min(3000, int(1e9 / (4 * numel))))


def time_calls(call: Callable[[], object], iters: int) -> list[float]:
    for _ in range(WARMUP):
        call()
    times = []
    for _ in range(iters):
        tic = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - tic) / 1e3)
    return times


def gloo_all_gather(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def rank_main(rank: int, world: int, cpus: list[int], fixed_iters: int | None) -> list:
    """One rank's timings (run by collect_from_ranks in a gloo world, one torch thread)."""
    from radixserve.distributed.shm_comm import ShmCommunicator

    os.sched_setaffinity(0, {cpus[rank]})
    comm = ShmCommunicator.create(dist.group.WORLD, "bench")
    if comm is None:
        raise SystemExit("the shared-memory communicator is not available (is sgl_kernel._cpu built?)")
    rows = []
    for op, shapes in (("all_reduce", REDUCE_SHAPES), ("all_gather", GATHER_SHAPES)):
        for shape in shapes:
            x = torch.zeros(shape)  # zeros: in-place sums stay finite however many calls run
            iters = iterations(x.numel(), fixed_iters)
            if op == "all_reduce":
                gloo = time_calls(lambda x=x: dist.all_reduce(x), iters)
                shm = time_calls(lambda x=x: comm.all_reduce_(x), iters)
            else:
                gloo = time_calls(lambda x=x: gloo_all_gather(x, world), iters)
                shm = time_calls(lambda x=x: comm.all_gather(x), iters)
            rows.append((op, shape, iters, gloo, shm))
    dist.barrier()
    comm.close()
    return rows


def p90(times: list[float]) -> float:
    return statistics.quantiles(times, n=10)[-1]


def print_table(rows: list, world: int, cpus: list[int]) -> None:
    print(
        f"\n{world} ranks pinned to CPUs {cpus[:world]}, 1 torch thread each; torch {torch.__version__}; "
        f"load average {os.getloadavg()[0]:.2f}; microseconds per call (rank 0)\n"
    )
    print(
        "| op | shape (per rank) | KiB per rank | iters | gloo median | gloo p90 | shm median | shm p90 | speed-up |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for op, shape, iters, gloo, shm in rows:
        kib = shape[0] * shape[1] * 4 / 1024
        g, s = statistics.median(gloo), statistics.median(shm)
        print(
            f"| {op} | {shape[0]}x{shape[1]} fp32 | {kib:.1f} | {iters} | {g:.1f} | {p90(gloo):.1f} | "
            f"{s:.1f} | {p90(shm):.1f} | {g / s:.1f}x |"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (processes)")
    p.add_argument(
        "--cpus", type=int, nargs="+", default=None, help="CPU of each rank (default: the first ones)"
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed calls per size (default: ~1 GB moved, 200-3000)"
    )
    args = p.parse_args(argv)
    cpus = args.cpus or sorted(os.sched_getaffinity(0))[: args.world]
    if len(cpus) < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} CPUs, have {cpus}")
    timeout_s = 3600.0  # a full run on a loaded box takes minutes; this bounds a hang
    rows = collect_from_ranks(rank_main, args.world, (cpus, args.iters), timeout_s=timeout_s)[
        0
    ]  # rank 0 times
    print_table(rows, args.world, cpus)


if __name__ == "__main__":
    main()
