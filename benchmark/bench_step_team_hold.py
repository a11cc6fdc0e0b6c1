"""One decode step of the built-in model with the step team held from the fused stack to the LM
head (ModelRunner.forward's `cpu_step_team`) against the stack's own scope only, alternated in one
process, step by step in blocks (issue 40: the greedy head inside the stack's team).

    python benchmark/bench_step_team_hold.py                       # batch 1, greedy, 2 threads
    python benchmark/bench_step_team_hold.py --rounds 20 --block 5 --threads 2

Per mode: the step's wall time (min, median) and the LM head's (ModelRunner._logits: the greedy
candidate pass, the exact re-score and the Python around them), the process's voluntary context
switches a step and the team's steps and regions a step (sgl_kernel.cpu.step_team_stats). Wall
time on a shared machine: read the minima, and the load average printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import radixserve  # noqa: F401  (sets the OpenMP spin before torch loads)

# isort: split
import torch

from radixserve import bench_one_batch
from radixserve.model_executor import model_runner as model_runner_module
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.model_loader.default_model import resolve_model_path
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from sgl_kernel import cpu as cpu_kernels

PANELS = {
    "cpu_wq_int8_activations": True,
    "cpu_kernel_tuning": "off",
    "cpu_kernel_crossovers": json.dumps({"wq_a8_max_tokens": 1}),
}
head_s = [0.0]


def _timed_logits(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        head_s[0] += time.perf_counter() - start
        return out

    return wrapper


def _stats(values: list[float]) -> str:
    return f"min {min(values) * 1e3:.2f} / median {statistics.median(values) * 1e3:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=5, help="steps of one mode in a row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--server-args", default=json.dumps(PANELS), help="ServerArgs fields as JSON")
    args = parser.parse_args()
    steps = args.rounds * args.block * 2
    server_args = ServerArgs(
        model_path=resolve_model_path(None),
        quantization="gguf",
        max_total_tokens=args.input_len + steps + 64,
        max_running_requests=1,
        **json.loads(args.server_args),
    ).resolve()
    worker = build_model_worker(server_args, bench_one_batch._model_config(server_args))
    torch.set_num_threads(args.threads)
    ModelRunner._logits = _timed_logits(ModelRunner._logits)
    held = model_runner_module.cpu_step_team
    modes = {"held (stack + head)": held, "stack only": lambda on: nullcontext(False)}
    runner = StaticBatchRunner(worker)
    vocab = worker.model_config.vocab_size
    prompt = bench_one_batch._random_prompts(1, args.input_len, vocab, 1)
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=steps + 4, temperature=0.0)) for p in prompt]
    runner.prefill(reqs)
    runner.decode(reqs)  # warm-up
    rows: dict[str, list[tuple[float, float, int, int, int]]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, fn in modes.items():
            model_runner_module.cpu_step_team = fn
            for _ in range(args.block):
                team0 = cpu_kernels.step_team_stats()
                vcsw0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                head_s[0] = 0.0
                start = time.perf_counter()
                runner.decode(reqs)
                wall = time.perf_counter() - start
                team1 = cpu_kernels.step_team_stats()
                vcsw = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - vcsw0
                rows[name].append(
                    (
                        wall,
                        head_s[0],
                        vcsw,
                        team1["steps"] - team0["steps"],
                        team1["regions"] - team0["regions"],
                    )
                )
    model_runner_module.cpu_step_team = held
    runner.release(reqs)
    print(f"batch 1, {args.threads} threads, load average {os.getloadavg()[0]:.1f}, {steps} steps")
    for name, r in rows.items():
        walls, heads, vcsw, team_steps, regions = zip(*r)
        print(
            f"  {name:20s} step {_stats(list(walls))}; head {_stats(list(heads))}; "
            f"{statistics.median(vcsw):.0f} switches, {statistics.median(team_steps):.0f} team scopes, "
            f"{statistics.median(regions):.0f} regions a step"
        )


if __name__ == "__main__":
    main()
