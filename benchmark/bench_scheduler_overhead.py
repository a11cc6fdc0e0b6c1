"""Scheduler CPU time per decode step with a null model worker (no math, real pools).

    python benchmark/bench_scheduler_overhead.py --batch-size 64 --input-len 128 --output-len 128

Compare the per-step number with a real decode step at the same batch size
(bench_one_batch's median decode latency) to get the scheduler's share of a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.build import build_loop
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server_args import ServerArgs
from radixserve.testing.null_worker import NullWorker


def run(batch_size: int, input_len: int, output_len: int, overlap: bool, vocab_size: int) -> list[float]:
    ctx = input_len + output_len + 8
    worker = NullWorker(batch_size * ctx + 64, batch_size, ctx, vocab_size)
    args = ServerArgs(
        max_running_requests=batch_size, disable_overlap_schedule=not overlap, device="cpu"
    ).resolve()
    sent: list[object] = []
    scheduler = Scheduler(args, worker, send_output=sent.append)
    loop = build_loop(scheduler)
    reqs = []
    for i in range(batch_size):
        sp = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        sp.normalize()
        prompt = [(i * 7919 + j) % (vocab_size - 2) + 1 for j in range(input_len)]
        reqs.append(TokenizedGenerateReqInput(f"r{i}", "", prompt, sp, stream=True))
    loop.step(reqs)
    step_times = []
    while not scheduler.is_idle():
        tic = time.perf_counter()
        loop.step([])
        step_times.append(time.perf_counter() - tic)
    loop.close()
    return step_times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=49152)
    args = parser.parse_args()
    for overlap in (False, True):
        times = run(args.batch_size, args.input_len, args.output_len, overlap, args.vocab_size)
        steady = times[2:-2] if len(times) > 8 else times
        print(
            f"overlap={overlap!s:5} bs={args.batch_size} steps={len(times)} "
            f"median={statistics.median(steady) * 1e3:.3f} ms mean={statistics.mean(steady) * 1e3:.3f} ms "
            f"p99={sorted(steady)[int(0.99 * (len(steady) - 1))] * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    main()
