"""Where a decode step of a (MoE) model goes, part by part, against the bytes it must read.

    python benchmark/profile_moe_decode.py /tmp/bench_moe_gguf/qwen3-30b-a3b-4l-q4_0.gguf --batch-size 1 16
    python benchmark/profile_moe_decode.py FILE.gguf --threads 2 --bandwidth \\
        --server-args '{"cpu_wq_int8_activations": true}'

Loads the model in-process (bench_moe_gguf.py writes the files), prefills --batch-size random
prompts, then times --steps greedy decode steps. Each part is wrapped where it is called and
charged its *exclusive* time (a wrapped callee's time goes to the callee), so the parts and
"the rest" add up to the step:

  LM head            the logits processor (the head's product and its glue)
  expert products    the experts' linear_wq calls, or a layer's one moe_wq_a8_packed call
  experts: other     silu_and_mul, and fused_experts_grouped's own sort / gather / combine
  router, top-k      the MoE block's own time (router linear, glue) and select_experts
  attention proj.    every qkv_proj / o_proj
  attention          RadixAttention (the backend and the KV store)
  rotary, norms      RotaryEmbedding, RMSNorm
  fused decoder      the CPU fused decode's one call (cpu_decode_runner: every layer, MoE ones
                     included, and the embedding) where it runs the step instead of the modules
  the rest           embedding, the layer loop, sampling, the runner's Python

Two clocks per part: the calling thread's CPU time (time.thread_time: what a busy machine does
not inflate; with --threads 2 it is the main thread's share, which includes its wait for the
other thread at the end of each parallel product) and wall time. Numbers from a shared machine
are indicative only. --bandwidth first measures what torch reads per second from a tensor far
larger than the caches (a sum and a copy, at 1 and at --threads threads), the bound the bytes per
token are held against.
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
from torch import nn

import radixserve.layers.logits_processor as logits_processor
import radixserve.layers.moe.fused_moe_cpu as fused_moe_cpu
import radixserve.layers.moe.layer as moe_layer
import radixserve.model_executor.cpu_decode_runner as cpu_decode_runner
import radixserve.models.moe_decoder as moe_decoder
from radixserve.bench_one_batch import _model_config
from radixserve.layers.attention.radix_attention import RadixAttention
from radixserve.layers.group_quant import GroupQuantWeight
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


class PartClock:
    """Exclusive thread-CPU and wall seconds per named part: a part's time less that of the
    wrapped parts it calls."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.wall: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._stack: list[list[float]] = []  # per open part: [child cpu, child wall]

    def clear(self) -> None:
        self.cpu.clear()
        self.wall.clear()
        self.calls.clear()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            self._stack.append([0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                child_cpu, child_wall = self._stack.pop()
                cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
                self.cpu[name] += cpu - child_cpu
                self.wall[name] += wall - child_wall
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][0] += cpu
                    self._stack[-1][1] += wall

        return wrapper


CLOCK = PartClock()


def instrument(model: nn.Module) -> None:
    """Wrap the parts where their callers look them up (module attributes and methods, read at
    call time; the attention projections per instance)."""
    fused_moe_cpu.linear_wq = CLOCK.wrap("expert products", fused_moe_cpu.linear_wq)
    # The one-call path (moe_wq_a8_packed: the products, SiLU and combine of a layer's experts).
    moe_layer.experts_on_panels = CLOCK.wrap("expert products", moe_layer.experts_on_panels)
    fused_moe_cpu.silu_and_mul = CLOCK.wrap("experts: other", fused_moe_cpu.silu_and_mul)
    moe_layer.fused_experts_grouped = CLOCK.wrap("experts: other", moe_layer.fused_experts_grouped)
    moe_decoder.select_experts = CLOCK.wrap("router, top-k", moe_decoder.select_experts)
    sparse = moe_decoder.SparseMoeBlock
    sparse.forward = CLOCK.wrap("router, top-k", sparse.forward)  # type: ignore[method-assign]
    for cls, name in ((RadixAttention, "attention"), (RotaryEmbedding, "rotary"), (RMSNorm, "norms")):
        cls.forward = CLOCK.wrap(name, cls.forward)  # type: ignore[method-assign]
    for module_name, module in model.named_modules():
        if module_name.endswith(("qkv_proj", "o_proj")):
            module.forward = CLOCK.wrap("attention projections", module.forward)  # type: ignore[method-assign]
    runner = cpu_decode_runner.CpuDecodeRunner
    runner.replay = CLOCK.wrap("fused decoder", runner.replay)  # type: ignore[method-assign]
    logits = logits_processor.LogitsProcessor
    logits.__call__ = CLOCK.wrap("LM head", logits.__call__)  # type: ignore[method-assign]


def _form_bytes(form: GroupQuantWeight) -> int:
    """What a product reads of a form: its panels where it has them, else its integers and scales."""
    return form.a8_packed.nbytes() if form.a8_packed is not None else form.nbytes()


def weight_bytes_per_token(model: nn.Module, lm_head: nn.Module | None, top_k: int) -> dict[str, int]:
    """Weight bytes one token's step reads: the LM head (the runner's, apart from the model), top_k
    experts' three projections per layer, the attention projections, the routers (fp32)."""
    parts: dict[str, int] = collections.defaultdict(int)
    head_form = getattr(getattr(lm_head, "local_head", lm_head), "weight_wq", None)
    if isinstance(head_form, GroupQuantWeight):
        parts["LM head"] += _form_bytes(head_form)
    for name, module in model.named_modules():
        form = getattr(module, "weight_wq", None)
        if isinstance(form, GroupQuantWeight) and name.endswith(("qkv_proj", "o_proj")):
            parts["attention projections"] += _form_bytes(form)
        if isinstance(module, FusedMoE) and module.experts_wq is not None:
            forms = module.experts_wq
            parts["expert products"] += top_k * (_form_bytes(forms.w13[0]) + _form_bytes(forms.w2[0]))
        if isinstance(module, moe_decoder.SparseMoeBlock):
            parts["router, top-k"] += module.gate.weight.numel() * module.gate.weight.element_size()
    return dict(parts)


def bandwidth_gbs(threads: int, gib: float = 1.0, repeats: int = 5) -> tuple[float, float]:
    """(read GB/s of a sum, read + write GB/s of a copy) over a fp32 tensor of `gib` GiB, best of
    `repeats`: the memory bound a step's bytes are measured against."""
    torch.set_num_threads(threads)
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    best_sum = best_copy = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        best_sum = min(best_sum, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - start)
    nbytes = src.numel() * 4
    return nbytes / best_sum / 1e9, 2 * nbytes / best_copy / 1e9


def profile_batch(
    runner: StaticBatchRunner, batch_size: int, steps: int, vocab: int, bytes_read: int
) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    prompts = torch.randint(100, vocab - 100, (batch_size, 32), generator=gen).tolist()
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=steps + 2, temperature=0.0)) for p in prompts]
    runner.prefill(reqs)
    runner.decode(reqs)  # first decode step: lazily made forms, caches
    CLOCK.clear()
    wall, cpu = [], []
    for _ in range(steps):
        start_wall, start_cpu = time.perf_counter(), time.thread_time()
        runner.decode(reqs)
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.thread_time() - start_cpu)
    runner.release(reqs)
    step_cpu, step_wall = sum(cpu) / steps, sum(wall) / steps
    print(
        f"== batch {batch_size}, {torch.get_num_threads()} thread(s): thread CPU {step_cpu * 1e3:.1f} ms, "
        f"wall {step_wall * 1e3:.1f} ms (median {statistics.median(wall) * 1e3:.1f}) per step; "
        f"one token's weights {bytes_read / 1e6:.1f} MB = {bytes_read / step_wall / 1e9:.1f} GB/s at that wall"
    )
    rest_cpu = step_cpu - sum(CLOCK.cpu.values()) / steps
    rest_wall = step_wall - sum(CLOCK.wall.values()) / steps
    rows = [(name, CLOCK.cpu[name] / steps, CLOCK.wall[name] / steps) for name in CLOCK.cpu]
    rows.sort(key=lambda row: -row[2])
    for name, part_cpu, part_wall in [*rows, ("the rest", rest_cpu, rest_wall)]:
        print(
            f"   {name:30s} CPU {part_cpu * 1e3:7.2f} ms {100 * part_cpu / step_cpu:5.1f}%   "
            f"wall {part_wall * 1e3:7.2f} ms {100 * part_wall / step_wall:5.1f}%   "
            f"calls/step {CLOCK.calls.get(name, 0) / steps:.0f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_path")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the server runs one per core)")
    parser.add_argument("--bandwidth", action="store_true", help="first measure torch's read/copy GB/s")
    parser.add_argument("--server-args", default="{}", help="ServerArgs fields as JSON")
    args = parser.parse_args(argv)
    if args.bandwidth:
        for threads in sorted({1, args.threads}):
            read, copy = bandwidth_gbs(threads)
            print(f"== bandwidth, {threads} thread(s): sum reads {read:.1f} GB/s, copy moves {copy:.1f} GB/s")
    torch.set_num_threads(args.threads)
    server_args = ServerArgs(
        model_path=args.model_path,
        max_total_tokens=max(args.batch_size) * (args.steps + 40) + 64,
        max_running_requests=max(args.batch_size),
        **json.loads(args.server_args),
    ).resolve()
    config = _model_config(server_args)
    worker = build_model_worker(server_args, config)
    model = worker.model_runner.model
    top_k = getattr(config.hf_config, "num_experts_per_tok", 0)
    parts = weight_bytes_per_token(model, worker.model_runner.lm_head, top_k)
    print("== weight bytes one token reads: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in parts.items()))
    instrument(model)
    runner = StaticBatchRunner(worker)
    for batch_size in args.batch_size:
        profile_batch(runner, batch_size, args.steps, config.vocab_size, sum(parts.values()))


if __name__ == "__main__":
    main()
