"""compare_peers' workloads (random prompts at each concurrency, the shared-prefix set) and one
bench_serving run of a workload against a server."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRIC_KEYS = (
    "completed",
    "failed",
    "duration_s",
    "total_input",
    "total_output",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
)


def num_prompts(concurrency: int, per_concurrency: float, minimum: int) -> int:
    return max(minimum, math.ceil(per_concurrency * concurrency))


# ----------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """One bench_serving run: a dataset at one concurrency."""

    name: str  # "random" | "shared-prefix"
    desc: str
    concurrency: int
    num_prompts: int
    max_len: int  # longest prompt + output, for llama-server's per-slot context
    dataset_args: tuple[str, ...]
    seed: int


def random_workloads(args: argparse.Namespace) -> list[Workload]:
    n_in, n_out = args.input_len, args.output_len
    return [
        Workload(
            name="random",
            desc=f"random {n_in}→{n_out}",
            concurrency=c,
            num_prompts=num_prompts(c, args.num_prompts_per_concurrency, args.min_num_prompts),
            max_len=n_in + n_out,
            dataset_args=(
                *("--dataset-name", "random-ids", "--random-range-ratio", "1.0"),
                *("--random-input-len", str(n_in), "--random-output-len", str(n_out)),
            ),
            # The same prompts for every engine at a given C, different ones for every C.
            seed=args.seed + c,
        )
        for c in args.concurrency
    ]


def shared_prefix_workload(args: argparse.Namespace) -> Workload:
    g, p, s, q, o = (
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
    )
    return Workload(
        name="shared-prefix",
        desc=f"shared prefix {g}×{p}, {s}+{q}→{o}",
        concurrency=args.gsp_concurrency,
        num_prompts=g * p,
        max_len=s + q + o,
        dataset_args=(
            *("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(g)),
            *("--gsp-prompts-per-group", str(p), "--gsp-system-prompt-len", str(s)),
            *("--gsp-question-len", str(q), "--gsp-output-len", str(o)),
        ),
        seed=args.seed + 100_000,
    )


def run_serving(engine: str, backend: str, base_url: str, w: Workload, tokenizer_dir: Path) -> dict[str, Any]:
    """One bench_serving run in this process; the result row for the report and the JSONL file."""
    from radixserve import bench_serving

    argv = [
        *("--backend", backend, "--base-url", base_url, "--tokenizer", str(tokenizer_dir)),
        *("--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.concurrency)),
        *("--seed", str(w.seed), "--warmup-requests", "1", "--disable-tqdm"),
        *w.dataset_args,
    ]
    print(f"\n=== {engine}: {w.desc}, concurrency {w.concurrency}, {w.num_prompts} prompts", flush=True)
    metrics = vars(bench_serving.main(argv))
    return {
        "engine": engine,
        "workload": w.name,
        "workload_desc": w.desc,
        "concurrency": w.concurrency,
        "num_prompts": w.num_prompts,
        **{k: metrics[k] for k in METRIC_KEYS},
        "errors": metrics["errors"][:5],
        "seed": w.seed,
        "bench_serving_argv": argv,
    }
