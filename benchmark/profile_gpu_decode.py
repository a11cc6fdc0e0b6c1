"""Where a decode step's time goes on a GPU (issue #44): host time vs kernel time, and the kernels.

    python benchmark/profile_gpu_decode.py --model-path .gpu_models/llama3-8b --batch-size 1 64

For each batch size: one prefill of `--input-len` random tokens, then `--steps` decode steps
through StaticBatchRunner (what bench_one_batch times) under the torch profiler, with the decode
CUDA graphs and then eagerly (graph runner detached, so each kernel is its own launch). It prints
the wall time per step, the GPU kernel time per step (the sum of the kernels' device time: what
the HBM bound compares with), the rest (host work the GPU waits for: building the batch, the
graph's inputs, the sampled tokens read back) and the kernels that take the most device time.
Runs on a CPU too (`--device cpu`: no kernel times), so the script is checked without a GPU.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def _device_us(event: Any) -> float:  # noqa: ANN401 - a profiler FunctionEventAvg
    return float(getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0))


def profile_steps(worker: Any, bs: int, input_len: int, steps: int, graphs: bool) -> dict[str, Any]:  # noqa: ANN401
    runner = StaticBatchRunner(worker)
    rng = random.Random(bs)
    vocab = worker.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(bs)]
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=steps + 3, temperature=0.0)) for p in prompts]
    model_runner = getattr(worker, "model_runner", None)
    saved = getattr(model_runner, "graph_runner", None)
    if not graphs and model_runner is not None:
        model_runner.graph_runner = None
    try:
        runner.prefill(reqs)
        runner.decode(reqs)  # warm-up
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            tic = time.perf_counter()
            for _ in range(steps):
                runner.decode(reqs)
            wall = (time.perf_counter() - tic) / steps
    finally:
        if model_runner is not None:
            model_runner.graph_runner = saved
        runner.release(reqs)
    # Kernels (and copies) only: an operator's own device time counts its kernels a second time.
    events = [e for e in prof.key_averages() if str(e.device_type).endswith("CUDA") and _device_us(e) > 0]
    kernel_s = sum(_device_us(e) for e in events) / 1e6 / steps
    top = sorted(events, key=_device_us, reverse=True)[:12]
    return {
        "bs": bs,
        "graphs": graphs,
        "wall_ms": wall * 1e3,
        "kernel_ms": kernel_s * 1e3,
        "top": [(e.key[:90], _device_us(e) / steps / 1e3, e.count // steps) for e in top],
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"### bs={r['bs']} {'CUDA graphs' if r['graphs'] else 'eager'}: wall {r['wall_ms']:.2f} ms/step, "
        f"kernels {r['kernel_ms']:.2f} ms/step, rest {r['wall_ms'] - r['kernel_ms']:.2f} ms",
        "",
        "| kernel | ms/step | launches/step |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{name}` | {ms:.3f} | {n} |" for name, ms, n in r["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the Markdown here too")
    args = parser.parse_args(argv)
    extra = {"device": args.device} if args.device else {}
    server_args = ServerArgs(
        model_path=args.model_path,
        load_format=args.load_format,
        max_total_tokens=max(args.batch_size) * (args.input_len + args.steps + 8) + 64,
        max_running_requests=max(args.batch_size),
        **extra,
    ).resolve()
    config = ModelConfig.from_path(server_args.model_path, dtype=server_args.dtype, device=server_args.device)
    worker = build_model_worker(server_args, config)
    text = ""
    for bs in args.batch_size:
        for graphs in (True, False):
            text += report(profile_steps(worker, bs, args.input_len, args.steps, graphs)) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
