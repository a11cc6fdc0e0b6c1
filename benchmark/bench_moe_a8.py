"""One MoE layer's routed experts through sgl-kernel's moe_wq_a8_packed (the one-call kernel over
int8-activation panels, --cpu-wq-int8-activations) at Qwen3-30B-A3B's layer shape, as Q4_0 or
Q8_0 experts with GGUF's fp16 scales, against the bytes the call must read.

    python benchmark/bench_moe_a8.py --tokens 1 16 128 --types Q4_0 Q8_0 --threads 2

Tokens are routed by softmax top-8 over random logits (new for every call, so the experts read
change, as from one step to the next). Per row: median ms per call, the distinct experts read,
their panel bytes and the GB/s that makes. The weights (one layer: ~340 MB at Q4_0) are far
above any L3, so each call streams them from memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.layers.moe.quantized import ExpertsWq, mark_int8_activations
from radixserve.layers.moe.topk import select_experts
from sgl_kernel import cpu as cpu_kernels

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768


def _form(n: int, k: int, kind: str, gen: torch.Generator) -> GroupQuantWeight:
    """GGUF's Q4_0 (w = d * (q - 8)) or Q8_0 (w = d * q), d an fp16 per 32 inputs."""
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    if kind == "Q4_0":
        q = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
        return GroupQuantWeight(q, scales, -8 * scales, 32, 4)
    q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    return GroupQuantWeight(q, scales, None, 32, 8)


def experts(kind: str, seed: int = 0) -> ExpertsWq:
    gen = torch.Generator().manual_seed(seed)
    w13 = tuple(_form(2 * INTER, HIDDEN, kind, gen) for _ in range(EXPERTS))
    w2 = tuple(_form(HIDDEN, INTER, kind, gen) for _ in range(EXPERTS))
    wq = mark_int8_activations(ExpertsWq(w13, w2), panels=True)
    assert wq.w13_panels is not None, "no stacked panels: sgl-kernel's panel kernel is not built"
    return wq


def bench(kind: str, tokens: list[int], repeats: int, isa: str) -> None:
    wq = experts(kind)
    per_expert = (wq.w13_panels.nbytes() + wq.w2_panels.nbytes()) / EXPERTS
    gen = torch.Generator().manual_seed(1)
    for n in tokens:
        x = torch.randn(n, HIDDEN, generator=gen)
        routes = [
            select_experts(torch.randn(n, EXPERTS, generator=gen), TOP_K, True) for _ in range(repeats + 1)
        ]
        times, cpu = [], []
        for i, (weights, ids) in enumerate(routes):
            tic, cpu0 = time.perf_counter(), time.thread_time()
            cpu_kernels.moe_wq_a8_packed(x, ids, weights, wq.w13_panels, wq.w2_panels, isa=isa)
            if i:  # the first call is a warm-up
                times.append(time.perf_counter() - tic)
                cpu.append(time.thread_time() - cpu0)
        ms = 1e3 * statistics.median(times)
        active = statistics.mean(len(torch.unique(ids)) for _, ids in routes)
        mb = active * per_expert / 1e6
        print(
            f"{kind} tokens {n:4d}  {ms:8.2f} ms wall (min {1e3 * min(times):.2f}, main thread CPU "
            f"{1e3 * statistics.median(cpu):.2f})  {active:5.1f} experts  "
            f"{mb:6.0f} MB  {mb / ms:5.1f} GB/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--types", nargs="+", default=["Q4_0"], choices=["Q4_0", "Q8_0"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--isa", default="auto")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for kind in args.types:
        bench(kind, args.tokens, args.repeats, args.isa)


if __name__ == "__main__":
    main()
