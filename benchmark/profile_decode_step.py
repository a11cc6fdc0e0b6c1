"""Where a decode step's wall time goes on CPU: decoder linears, the LM head, decode attention,
sampling, and the rest (norms, rotary, KV writes, batch setup, Python), by timing wrappers.

    python benchmark/profile_decode_step.py                                  # built-in model, b=16 and 64
    python benchmark/profile_decode_step.py --server-args '{"disable_cpu_bf16_gemm": true}'
    python benchmark/profile_decode_step.py --threads 1 --batch-size 64
    python benchmark/profile_decode_step.py --batch-size 1 --temperature 0 --threads 1 --cpu-time
    python benchmark/profile_decode_step.py --batch-size 1 --temperature 0 --parts   # inside the stack
    python benchmark/profile_decode_step.py --prefill --batch-size 1 --input-len 2048 --threads 1 --cpu-time

--prefill times the prefill of the batch's prompts instead (one forward of batch x input-len
tokens, no chunking), with the cpu attention backend's forward_extend as "attention": where a
long prompt's time goes.

The torch profiler does not see sgl-kernel's attention and norm calls (they bypass the dispatcher)
and distorts short ops, so this wraps `layers.linear.linear` (decoder linears), the cpu attention
backend's forward_decode, the fused decode stack (CpuDecodeRunner.replay: small batches run the
whole decoder in one compiled call that the other wrappers never see), the LM head
(ModelRunner._logits: the greedy head or the full one) and ModelRunner.sample with wall clocks, and reports medians over --steps steps of a static batch
(radixserve.bench_one_batch's runner; prompts of --input-len random tokens). Sampling at
--temperature 0.8 by default: temperature 0 would read the greedy head (layers/greedy_head.py)
instead of the full one. --parts also splits the fused stack's forward (DecodeModel) into its
parts, per layer (sgl-kernel's RADIXSERVE_DECODE_TIMERS: wall laps on the calling thread, each
part's parallel region included; with --cpu-time the thread's CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

# radixserve before torch: its import sets the OpenMP workers' spin (GOMP_SPINCOUNT, utils/cpus.py)
# that the served scheduler runs with, and the runtime reads it once, when torch loads it.
import radixserve  # noqa: F401

# isort: split
import torch

from radixserve import bench_one_batch
from radixserve.layers import linear as linear_module
from radixserve.layers.attention.cpu_backend import CpuAttnBackend
from radixserve.model_executor.cpu_decode_runner import CpuDecodeRunner
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.model_loader.default_model import resolve_model_path
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from sgl_kernel import cpu as cpu_kernels

HEAD_ROWS = 10_000  # a linear with more output rows than this is the LM head (vocabularies)
PARTS = ("decoder linears", "LM head", "attention", "fused stack", "sampling")
# The head's linear call runs inside ModelRunner._logits, which is timed as "LM head" already.
NESTED = "nested"
spent = dict.fromkeys((*PARTS, NESTED), 0.0)
# The wall clock; with --cpu-time on one thread, that thread's CPU time (a shared machine's
# descheduling left out, its memory traffic not).
clock: Callable[[], float] = time.perf_counter


def _timed(fn: Callable[..., Any], part: Callable[..., str]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        out = fn(*args, **kwargs)
        spent[part(*args)] += clock() - start
        return out

    return wrapper


def _install_timers() -> None:
    def linear_part(x: torch.Tensor, weight: torch.Tensor, *_: Any) -> str:
        return NESTED if weight.shape[0] > HEAD_ROWS else "decoder linears"

    # Linear.forward looks `linear` up in its module at call time, so the wrapper sees every call.
    linear_module.linear = _timed(linear_module.linear, linear_part)
    CpuAttnBackend.forward_decode = _timed(CpuAttnBackend.forward_decode, lambda *_: "attention")
    CpuAttnBackend.forward_extend = _timed(CpuAttnBackend.forward_extend, lambda *_: "attention")
    ModelRunner.sample = _timed(ModelRunner.sample, lambda *_: "sampling")
    # Small batches run the decoder stack in one compiled call (cpu_decode_runner.py), which the
    # wrappers above never see: time that call, and the LM head (greedy or full) as a whole.
    CpuDecodeRunner.replay = _timed(CpuDecodeRunner.replay, lambda *_: "fused stack")
    ModelRunner._logits = _timed(ModelRunner._logits, lambda *_: "LM head")


def profile(
    runner: StaticBatchRunner, prompts: list[list[int]], steps: int, temperature: float, prefill: bool = False
) -> str:
    """One line: the median step (a decode step, or with `prefill` the prompts' prefill) and each
    part's median ms and share."""
    params = SamplingParams(max_new_tokens=steps + 4, temperature=temperature)
    reqs = [StaticReq(p, params) for p in prompts]
    runner.prefill(reqs)
    runner.decode(reqs)  # warm-up
    cpu_kernels.decode_model_timers(reset=True)
    if prefill:
        runner.release(reqs)

    def step() -> None:
        if not prefill:
            runner.decode(reqs)
            return
        fresh = [StaticReq(p, params) for p in prompts]
        runner.prefill(fresh)
        runner.release(fresh)

    rows = []
    cpu = []  # the process's CPU time a step, all threads: what a served step's CPU is compared with
    switches = []  # voluntary context switches a step, all threads (OpenMP workers that slept)
    for _ in range(steps):
        for part in PARTS:
            spent[part] = 0.0
        cpu_start, vcsw_start = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        start = clock()
        step()
        rows.append((clock() - start, *(spent[p] for p in PARTS)))
        cpu.append(time.process_time() - cpu_start)
        switches.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - vcsw_start)
    if not prefill:
        runner.release(reqs)
    total, *parts = (statistics.median(column) * 1e3 for column in zip(*rows))
    shares = [f"{name} {ms:.1f} ({100 * ms / total:.0f}%)" for name, ms in zip(PARTS, parts)]
    rest = total - sum(parts)
    line = " + ".join([*shares, f"rest {rest:.1f} ({100 * rest / total:.0f}%)"])
    cpu_ms, vcsw = statistics.median(cpu) * 1e3, statistics.median(switches)
    least = [min(column) * 1e3 for column in zip(*rows)]  # a shared machine's least disturbed
    minima = ", ".join(f"{name} {ms:.2f}" for name, ms in zip(("step", *PARTS), least) if ms > 0)
    summary = (
        f"step {total:.1f} ms (process CPU {cpu_ms:.1f} ms, {vcsw:.0f} voluntary switches) = {line}"
        f"\n  minima (ms): {minima}"
    )
    return summary + _stack_parts(runner.worker.model_config.num_layers)


def _stack_parts(layers: int) -> str:
    """The fused stack's parts as us per layer a forward (mean), or nothing when not timed."""
    parts, forwards = cpu_kernels.decode_model_timers(reset=True)
    if forwards == 0:
        return ""
    cells = [f"{name} {1e3 * ms / forwards / layers:.1f}" for name, ms in parts.items() if name != "other"]
    per_forward = sum(parts.values()) / forwards
    other = 1e3 * parts["other"] / forwards
    return (
        f"\n  stack {per_forward:.2f} ms a forward; us a layer: {', '.join(cells)}; "
        f"outside the layers {other:.0f} us a forward"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the server's)")
    parser.add_argument("--server-args", default="{}", help="ServerArgs fields as JSON")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time by the thread's CPU time (needs --threads 1)"
    )
    parser.add_argument("--parts", action="store_true", help="split the fused stack's forward into its parts")
    parser.add_argument("--prefill", action="store_true", help="time the prompts' prefill, not a decode step")
    args = parser.parse_args()
    if args.parts:  # read by sgl-kernel at the first forward; "cpu": the thread's CPU time
        os.environ["RADIXSERVE_DECODE_TIMERS"] = "cpu" if args.cpu_time else "1"
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time needs --threads 1 (other threads' time would be left out)")
        global clock
        clock = time.thread_time
    max_bs = max(args.batch_size)
    fields = {
        "model_path": resolve_model_path(None),
        "quantization": "gguf",  # the built-in model's CPU default (a resolved path is not "the built-in")
        "max_total_tokens": max_bs * (args.input_len + args.steps + 8) + 64,
        "max_running_requests": max_bs,
    }
    fields.update(json.loads(args.server_args))  # may name another model_path
    server_args = ServerArgs(**fields).resolve()
    worker = build_model_worker(server_args, bench_one_batch._model_config(server_args))
    torch.set_num_threads(args.threads or server_args.cpu_threads or torch.get_num_threads())
    _install_timers()
    vocab = worker.model_config.vocab_size
    for bs in args.batch_size:
        prompts = bench_one_batch._random_prompts(bs, args.input_len, vocab, bs)
        line = profile(StaticBatchRunner(worker), prompts, args.steps, args.temperature, args.prefill)
        what = f"prefill {bs} x {args.input_len}" if args.prefill else f"batch {bs}"
        print(f"{what} ({torch.get_num_threads()} threads): {line}", flush=True)


if __name__ == "__main__":
    main()
