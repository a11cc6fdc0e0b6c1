"""decode_attention on one long request whose K/V rows come from memory, as in a served step: the
pools of --layers layers read in turn, with other reads (standing in for the layers' weights)
between them, wall time per call on --threads threads. --layers 1 keeps the rows warm.

    python benchmark/bench_decode_attention_cold.py                      # 2048 tokens, 30 layers
    python benchmark/bench_decode_attention_cold.py --layers 1           # the same rows, warm
"""

from __future__ import annotations

import argparse
import time

import torch

from sgl_kernel import cpu as cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim, n = 9, 3, 64, args.tokens + 16  # the built-in model's attention
    ks = [torch.randn(n, kv_heads, dim).bfloat16() for _ in range(args.layers)]
    vs = [torch.randn(n, kv_heads, dim).bfloat16() for _ in range(args.layers)]
    q = torch.randn(1, heads, dim)
    req_to_token = torch.arange(n, dtype=torch.int32).view(1, n)
    pool_idx, seq_lens = torch.zeros(1, dtype=torch.int64), torch.tensor([args.tokens])
    other = torch.randn(args.layers, 600_000)  # ~2.4 MB of other reads a layer

    def call(i: int) -> None:
        cpu_kernels.decode_attention(q, ks[i], vs[i], req_to_token, pool_idx, seq_lens, dim**-0.5)

    for _ in range(3):
        for i in range(args.layers):
            call(i)
    times = []
    for _ in range(args.rounds):
        for i in range(args.layers):
            other[i].sum()
            t0 = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - t0)
    times.sort()
    print(
        f"{args.tokens} tokens, {args.layers} layers' pools, {args.threads} threads: "
        f"min {times[0] * 1e6:.0f} us, median {times[len(times) // 2] * 1e6:.0f} us a call"
    )


if __name__ == "__main__":
    main()
