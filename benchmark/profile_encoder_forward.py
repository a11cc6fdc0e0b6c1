"""Where a BERT embedding forward spends its time, per op, and the work it does beside
sentence-transformers' encode: CPU seconds on one thread each (docs/benchmarks.md, "Embeddings").

    python benchmark/profile_encoder_forward.py                      # 64 x 256 tokens, bge-small shape
    python benchmark/profile_encoder_forward.py --inputs 16 --no-st  # the op table only

The checkpoint and inputs are bench_embeddings.py's (a random BERT of bge-small's shape, inputs of
exactly --tokens tokens). radixserve runs in this process through the real scheduler
(InProcessScheduler: batch formation, the forward, pooling), sentence-transformers' encode
(batch 32) too. Both on one torch thread and timed in process CPU seconds: on a shared machine
wall time measures the other tenants as much as the code (two OpenMP threads wait at every
barrier for a descheduled sibling), while one thread's CPU time is the work done. The ratio of the
two CPU times is a load-independent stand-in for the 2-thread wall-clock ratio that
bench_embeddings.py measures on an idle machine, not a replacement for it.

The op table is torch.profiler's self time of one encode pass, grouped: the linears (oneDNN over
prepacked weights, GELU fused), attention (SDPA), LayerNorm, and the rest. It is wall clock on
one thread: under load its seconds stretch, its shares hold better.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_embeddings import make_inputs, make_model  # noqa: E402

GROUPS = {
    "mkldnn::_linear_pointwise": "linears (oneDNN GEMM, bias, fused GELU)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
    "aten::native_layer_norm": "LayerNorm",
    "aten::gelu": "GELU (unfused)",
    "aten::add_": "residual adds",
    "aten::index_select": "embedding lookups",
}


def cpu_seconds(fn: Any, repeats: int) -> float:  # noqa: ANN401
    """The least process CPU time of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def op_table(run: Any) -> list[tuple[str, float]]:  # noqa: ANN401
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    groups: Counter[str] = Counter()
    for event in prof.key_averages():
        groups[GROUPS.get(event.key, "other ops")] += event.self_cpu_time_total / 1e6
    return groups.most_common()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-st", action="store_true", help="skip sentence-transformers")
    args = parser.parse_args()
    from radixserve.testing.inprocess import InProcessScheduler

    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        make_model(path, "bge-small")
        texts, ids = make_inputs(path, args.inputs, args.tokens)
        sched = InProcessScheduler(
            str(path),
            max_total_tokens=max(4 * args.inputs * args.tokens, 8192),
            disable_overlap_schedule=True,  # the CPU default
            log_level="warning",
        )
        count = iter(range(10**9))

        def encode() -> None:
            tag = next(count)
            for i, x in enumerate(ids):
                sched.submit_embedding(f"{tag}.{i}", x)
            sched.run_until_idle()

        try:
            rs = cpu_seconds(encode, args.repeats)
            table = op_table(encode)
        finally:
            sched.close()
        st = None
        if not args.no_st:
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(str(path), device="cpu")
            model.max_seq_length = args.tokens
            st = cpu_seconds(lambda: model.encode(texts, batch_size=32), args.repeats)
    print(
        f"{args.inputs} inputs x {args.tokens} tokens, bge-small shape, 1 torch thread, "
        f"load average {load_start:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(f"radixserve (scheduler path): {rs:.3f} CPU s")
    if st is not None:
        print(f"sentence-transformers encode: {st:.3f} CPU s -> radixserve does {st / rs:.2f}x less work")
    total = sum(sec for _, sec in table)
    print("| op group | profiler seconds (wall) | share |\n|---|---:|---:|")
    for name, sec in table:
        print(f"| {name} | {sec:.3f} | {100 * sec / total:.1f}% |")


if __name__ == "__main__":
    main()
