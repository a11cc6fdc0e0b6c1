"""Where a decode step of a (MoE) model goes, part by part, in thread CPU time.

    python benchmark/profile_moe_decode.py /tmp/bench_moe_gguf/qwen3-30b-a3b-4l-q4_0.gguf --batch-size 1 16
    python benchmark/profile_moe_decode.py FILE.gguf --server-args '{"cpu_wq_int8_activations": true}'

Loads the model in-process (bench_moe_gguf.py writes the files), prefills --batch-size random
prompts, then times --steps greedy decode steps. It runs on one thread by default and reports each
part's thread CPU time (time.thread_time), which a busy machine does not inflate the way it does
wall time: the parts are wrapped where they are called (the experts' linear_wq, the dense
linears' linear_wq, the MoE block, the logits processor), so a part's time includes its callees.
Numbers from a shared machine are indicative only; wall time is printed beside them.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import radixserve.layers.linear as dense_linear
import radixserve.layers.logits_processor as logits_processor
import radixserve.layers.moe.fused_moe_cpu as fused_moe_cpu
import radixserve.layers.moe.layer as moe_layer
import radixserve.models.moe_decoder as moe_decoder
from radixserve.bench_one_batch import _model_config
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

CPU_S: dict[str, float] = collections.defaultdict(float)
CALLS: dict[str, int] = collections.defaultdict(int)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            CPU_S[name] += time.thread_time() - start
            CALLS[name] += 1

    return wrapper


def instrument() -> None:
    """Wrap the parts where their callers look them up (module attributes, read at call time)."""
    fused_moe_cpu.linear_wq = _timed("moe: experts' linear_wq", fused_moe_cpu.linear_wq)
    fused_moe_cpu.silu_and_mul = _timed("moe: silu_and_mul", fused_moe_cpu.silu_and_mul)
    moe_layer.fused_experts_grouped = _timed("moe: fused_experts_grouped", moe_layer.fused_experts_grouped)
    moe_decoder.select_experts = _timed("moe: select_experts (router top-k)", moe_decoder.select_experts)
    moe_decoder.SparseMoeBlock.forward = _timed(
        "moe block (router + experts)", moe_decoder.SparseMoeBlock.forward
    )
    dense_linear.linear_wq = _timed("dense linear_wq (attention, LM head)", dense_linear.linear_wq)
    logits_processor.LogitsProcessor.__call__ = _timed(
        "logits processor (LM head)", logits_processor.LogitsProcessor.__call__
    )


def profile_batch(runner: StaticBatchRunner, batch_size: int, steps: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    prompts = torch.randint(100, vocab - 100, (batch_size, 32), generator=gen).tolist()
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=steps + 2, temperature=0.0)) for p in prompts]
    runner.prefill(reqs)
    runner.decode(reqs)  # first decode step: lazily made forms, caches
    CPU_S.clear()
    CALLS.clear()
    wall, cpu = [], []
    for _ in range(steps):
        start_wall, start_cpu = time.perf_counter(), time.thread_time()
        runner.decode(reqs)
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.thread_time() - start_cpu)
    runner.release(reqs)
    step_cpu = sum(cpu) / steps
    print(
        f"== batch {batch_size}: thread CPU {step_cpu * 1e3:.1f} ms per step "
        f"(wall median {statistics.median(wall) * 1e3:.1f} ms)"
    )
    for name in sorted(CPU_S, key=lambda k: -CPU_S[k]):
        per_step = CPU_S[name] / steps
        print(
            f"   {name:40s} {per_step * 1e3:8.1f} ms {100 * per_step / step_cpu:5.1f}%  "
            f"calls/step {CALLS[name] / steps:.0f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_path")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="1: thread CPU time is the whole cost")
    parser.add_argument("--server-args", default="{}", help="ServerArgs fields as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    server_args = ServerArgs(
        model_path=args.model_path,
        max_total_tokens=max(args.batch_size) * (args.steps + 40) + 64,
        max_running_requests=max(args.batch_size),
        **json.loads(args.server_args),
    ).resolve()
    config = _model_config(server_args)
    worker = build_model_worker(server_args, config)
    instrument()
    runner = StaticBatchRunner(worker)
    for batch_size in args.batch_size:
        profile_batch(runner, batch_size, args.steps, config.vocab_size)


if __name__ == "__main__":
    main()
