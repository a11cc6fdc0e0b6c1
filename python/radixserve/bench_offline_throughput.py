"""Offline throughput: one Engine.generate over a whole dataset, no HTTP.

    python -m radixserve.bench_offline_throughput --num-prompts 64 --random-input-len 128 \
        --random-output-len 128 --random-range-ratio 1.0

Prints an SGLang-style result block and appends one JSON line to --result-file.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from radixserve.benchmark_utils.datasets import DatasetRow, gen_random_ids, synthetic_dataset, vocab_choices


def build_dataset(args: argparse.Namespace, vocab_size: int) -> list[DatasetRow]:
    return synthetic_dataset(args, random.Random(args.seed), vocab_choices(vocab_size))


def run(engine: Any, rows: list[DatasetRow]) -> dict[str, Any]:  # noqa: ANN401 - an Engine
    params = [{"max_new_tokens": r.output_len, "temperature": 0.0, "ignore_eos": True} for r in rows]
    tic = time.perf_counter()
    outs = engine.generate(input_ids=[r.prompt for r in rows], sampling_params=params)
    duration = time.perf_counter() - tic
    input_tokens = sum(r.prompt_len for r in rows)
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"].get("cached_tokens", 0) for o in outs)
    return {
        "successful_requests": len(outs),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_tokens": cached,
        "request_throughput": len(outs) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
    }


def print_block(result: dict[str, Any]) -> None:
    print("\n====== Offline Throughput Benchmark Result =======")
    print(f"{'Successful requests:':<40}{result['successful_requests']:<10}")
    print(f"{'Benchmark duration (s):':<40}{result['duration_s']:<10.2f}")
    print(f"{'Total input tokens:':<40}{result['total_input_tokens']:<10}")
    print(f"{'Total generated tokens:':<40}{result['total_output_tokens']:<10}")
    print(f"{'Cached prompt tokens:':<40}{result['cached_tokens']:<10}")
    print(f"{'Request throughput (req/s):':<40}{result['request_throughput']:<10.2f}")
    print(f"{'Input token throughput (tok/s):':<40}{result['input_throughput']:<10.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:<10.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{result['total_throughput']:<10.2f}")
    print("=" * 50)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dataset-name", choices=["random-ids", "generated-shared-prefix"], default="random-ids"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=1.0)
    parser.add_argument("--gsp-num-groups", type=int, default=8)
    parser.add_argument("--gsp-prompts-per-group", type=int, default=8)
    parser.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    parser.add_argument("--gsp-question-len", type=int, default=64)
    parser.add_argument("--gsp-output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--result-file", default=None)
    parser.add_argument(
        "--server-args", default="{}", help="Engine arguments as JSON, e.g. '{\"disable_radix_cache\": true}'"
    )
    parser.add_argument("--model-path", default=None)
    args = parser.parse_args(argv)

    from radixserve.entrypoints.engine import Engine

    with Engine(model_path=args.model_path, **json.loads(args.server_args)) as engine:
        vocab_size = engine.tokenizer_manager.vocab_size
        rows = build_dataset(args, vocab_size)
        # Warm-up on unrelated prompts: one-time costs are not measured, and nothing is pre-cached.
        warmup_rng = random.Random(args.seed + 10_000)
        run(engine, gen_random_ids(warmup_rng, 4, 32, 8, 1.0, vocab_choices(vocab_size)))
        result = run(engine, rows)
    print_block(result)
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps({**vars(args), **result}) + "\n")


if __name__ == "__main__":
    main()
