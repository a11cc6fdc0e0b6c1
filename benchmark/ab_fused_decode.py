"""Decode steps with the CPU fused stack (cpu_decode_runner.py) and with the module forward,
interleaved in one process over the same worker, weights and crossovers: a shared machine's load
swings between processes, so a step of each kind alternates and the medians are compared.

    python benchmark/ab_fused_decode.py                          # built-in model (GGUF), b=16 and 64
    python benchmark/ab_fused_decode.py --batch-size 1 16 --steps 12

Prints per batch size and path: the median step (wall), the process's CPU time a step (all
threads) and its voluntary context switches a step (OpenMP workers that slept between parallel
regions switch voluntarily). A batch the fused stack does not take (its bound: the log line at
start) runs the module forward on both sides.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

# radixserve before torch: its import sets the OpenMP workers' spin that the server runs with.
import radixserve  # noqa: F401

# isort: split
import torch

from radixserve import bench_one_batch
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.model_loader.default_model import resolve_model_path
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def _step(runner: StaticBatchRunner, reqs: list[StaticReq]) -> tuple[float, float, int]:
    cpu, switches, start = (
        time.process_time(),
        resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw,
        time.perf_counter(),
    )
    runner.decode(reqs)
    wall = time.perf_counter() - start
    return wall, time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches


def ab(worker: TpModelWorker, bs: int, input_len: int, steps: int) -> list[str]:
    """`steps` steps of each path after one warm-up of each, alternating; one line per path."""
    model_runner = worker.model_runner
    fused = model_runner.cpu_decode_runner
    prompts = bench_one_batch._random_prompts(bs, input_len, worker.model_config.vocab_size, bs)
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=2 * steps + 4, temperature=0.0)) for p in prompts]
    runner = StaticBatchRunner(worker)
    runner.prefill(reqs)
    rows: dict[str, list[tuple[float, float, int]]] = {"fused": [], "module forward": []}
    try:
        for i in range(2 * steps + 2):
            path = "fused" if i % 2 == 0 else "module forward"
            model_runner.cpu_decode_runner = fused if path == "fused" else None
            sample = _step(runner, reqs)
            if i >= 2:  # the first of each warms up
                rows[path].append(sample)
    finally:
        model_runner.cpu_decode_runner = fused
        runner.release(reqs)
    lines = []
    for path, samples in rows.items():
        wall, cpu, switches = (statistics.median(column) for column in zip(*samples))
        lines.append(
            f"batch {bs} {path}: step {wall * 1e3:.1f} ms, process CPU {cpu * 1e3:.1f} ms, "
            f"{switches:.0f} voluntary switches (median of {len(samples)})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="steps of each path")
    parser.add_argument("--server-args", default="{}", help="ServerArgs fields as JSON")
    args = parser.parse_args()
    max_bs = max(args.batch_size)
    server_args = ServerArgs(
        model_path=resolve_model_path(None),
        quantization="gguf",  # the built-in model's CPU default (a resolved path is not "the built-in")
        max_total_tokens=max_bs * (args.input_len + 2 * args.steps + 8) + 64,
        max_running_requests=max_bs,
        **json.loads(args.server_args),
    ).resolve()
    worker = build_model_worker(server_args, bench_one_batch._model_config(server_args))
    torch.set_num_threads(server_args.cpu_threads or torch.get_num_threads())
    if worker.model_runner.cpu_decode_runner is None:
        raise SystemExit("no fused decode for this model and these flags: nothing to compare")
    print(f"fused stack takes batches of <= {worker.model_runner.cpu_decode_runner.max_bs}", flush=True)
    for bs in args.batch_size:
        for line in ab(worker, bs, args.input_len, args.steps):
            print(line, flush=True)


if __name__ == "__main__":
    main()
