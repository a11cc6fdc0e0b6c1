"""One MoE layer's experts at Qwen3-30B-A3B's shape: the grouped kernel (what the models run) vs
the torch-native reference (dense masks).

    python benchmark/bench_moe_layer.py                      # fp32 and bf16, 1 and 16 tokens
    python benchmark/bench_moe_layer.py --tokens 1 4 16 64 --dtypes float32 --repeats 20

The shape is hidden 2048, 128 experts, top-8, moe_intermediate_size 768 (Qwen3-30B-A3B's per-layer
MoE; 2.4 GB of fp32 expert weights, far above any L3). Tokens are routed by softmax top-k over
random logits, drawn anew for every call so the experts read change from call to call, as from
one decode step to the next. Per row: ms per call (median of --repeats after a warm-up), the
bytes of the experts the grouped kernel reads (those at least one token chose) and the GB/s
that makes; the reference reads every expert and computes every token through each of them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.layers.moe.fused_moe_cpu import fused_experts_grouped
from radixserve.layers.moe.fused_moe_native import fused_experts_native
from radixserve.layers.moe.topk import select_experts

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def time_calls(fn, routes: list[tuple[torch.Tensor, torch.Tensor]]) -> float:  # noqa: ANN001
    """Median ms of fn(weights, ids) over `routes` (the first one is a warm-up)."""
    fn(*routes[0])
    times = []
    for weights, ids in routes[1:]:
        tic = time.perf_counter()
        fn(weights, ids)
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


def bench(dtype: torch.dtype, tokens: list[int], repeats: int, native_repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.empty(EXPERTS, 2 * INTER, HIDDEN, dtype=dtype).normal_(0, 0.02, generator=gen)
    w2 = torch.empty(EXPERTS, HIDDEN, INTER, dtype=dtype).normal_(0, 0.02, generator=gen)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    for n in tokens:
        x = torch.randn(n, HIDDEN, generator=gen).to(dtype)
        routes = [
            select_experts(torch.randn(n, EXPERTS, generator=gen), TOP_K, True) for _ in range(repeats + 1)
        ]
        grouped = time_calls(lambda w, i, x=x: fused_experts_grouped(x, w13, w2, w, i), routes)
        native = time_calls(
            lambda w, i, x=x: fused_experts_native(x, w13, w2, w, i), routes[: native_repeats + 1]
        )
        active = statistics.mean(len(torch.unique(ids)) for _, ids in routes)
        read = active * expert_bytes / 1e9
        print(
            f"{str(dtype).removeprefix('torch.'):9s} tokens {n:4d}  grouped {grouped:8.2f} ms "
            f"({active:5.1f} experts, {read * 1e3:6.0f} MB, {read / grouped * 1e3:5.1f} GB/s)  "
            f"native {native:9.2f} ms  speedup {native / grouped:6.1f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--native-repeats", type=int, default=3, help="the reference is slow")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.dtypes:
        bench(DTYPES[name], args.tokens, args.repeats, args.native_repeats)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
