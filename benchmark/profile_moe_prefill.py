"""Where a prefill of a (MoE) model goes, in thread CPU time, and how its expert groups split by size.

    python benchmark/profile_moe_prefill.py /tmp/bench_moe_gguf/qwen3-30b-a3b-4l-q4_0.gguf \
        --server-args '{"cpu_wq_int8_activations": true}'

Loads the model in-process (bench_moe_gguf.py writes the files), prefills --tokens random tokens
--repeats times, and prints each part's thread CPU time over all repeats (profile_moe_decode.py's
instrumentation) and the expert projections grouped by their row count. One thread by default, so
thread CPU time is the whole cost even on a shared machine; indicative only.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any

import profile_moe_decode as parts
import torch

import radixserve.layers.moe.fused_moe_cpu as fused_moe_cpu
from radixserve.bench_one_batch import _model_config
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

BUCKETS = (8, 16, 64)  # group sizes reported: <= 8, <= 16, <= 64, larger
GROUPS: collections.Counter[str] = collections.Counter()
GROUP_S: dict[str, float] = collections.defaultdict(float)


def _bucket(rows: int) -> str:
    return next((f"<= {b} rows" for b in BUCKETS if rows <= b), f"> {BUCKETS[-1]} rows")


def instrument_groups() -> None:
    project = fused_moe_cpu._project

    def timed(x: torch.Tensor, *args: Any) -> torch.Tensor:  # noqa: ANN401
        start = time.thread_time()
        try:
            return project(x, *args)
        finally:
            GROUPS[_bucket(x.shape[0])] += 1
            GROUP_S[_bucket(x.shape[0])] += time.thread_time() - start

    fused_moe_cpu._project = timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_path")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--server-args", default="{}", help="ServerArgs fields as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    server_args = ServerArgs(
        model_path=args.model_path,
        max_total_tokens=4 * args.tokens,
        max_running_requests=4,
        **json.loads(args.server_args),
    ).resolve()
    config = _model_config(server_args)
    worker = build_model_worker(server_args, config)
    runner = StaticBatchRunner(worker)
    instrument_groups()  # the grouped path (layers without the one-call kernel)
    parts.instrument(worker.model_runner.model)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.repeats):
        prompt = torch.randint(100, config.vocab_size - 100, (args.tokens,), generator=gen).tolist()
        reqs = [StaticReq(prompt, SamplingParams(max_new_tokens=2, temperature=0.0))]
        wall, cpu = time.perf_counter(), time.thread_time()
        runner.prefill(reqs)
        print(
            f"prefill {i}: thread CPU {1e3 * (time.thread_time() - cpu):.0f} ms, "
            f"wall {1e3 * (time.perf_counter() - wall):.0f} ms"
        )
        runner.release(reqs)
    cpu_s = parts.CLOCK.cpu  # each part's exclusive thread CPU seconds
    for name in sorted(cpu_s, key=lambda k: -cpu_s[k]):
        print(f"  {name:40s} {1e3 * cpu_s[name] / args.repeats:8.1f} ms per prefill")
    for bucket in sorted(GROUPS):
        print(f"  expert groups {bucket}: {GROUPS[bucket]} projections, {1e3 * GROUP_S[bucket]:.1f} ms")


if __name__ == "__main__":
    main()
