"""Data parallelism on one machine: dispatch methods side by side, and dp=2 against dp=1.

    python benchmark/bench_data_parallel.py dispatch     # cache_aware vs round_robin, dp=2
    python benchmark/bench_data_parallel.py scale        # dp=2 (1 thread each) vs dp=1 (2 threads)

`dispatch` runs the generated-shared-prefix workload (8 groups x 8 prompts, shuffled so groups
interleave) against one --dp-size 2 server per method, one after the other with the same prompts
(a fixed seed), and reports the share of prompt tokens served from the replicas' prefix caches
(summed over the replicas' /get_server_info internal_states) and the output throughput.
`scale` runs random prompts at a concurrency of 64 against dp=1 and dp=2 with the same cores.
Each server is started fresh (cold caches), and stopped before the next one starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from peers.process import ServerProcess, free_port

from radixserve.bench_serving import main as bench_serving


@contextlib.contextmanager
def server(model: str, flags: list[str]) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--model-path", model, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"bench_data_parallel_{port}.log"
    with ServerProcess("radixserve", [*cmd, *flags, "--log-level", "warning"], log, url) as proc:
        proc.wait_healthy(600)
        yield url


def cache_counters(url: str) -> tuple[int, int]:
    states = httpx.get(f"{url}/get_server_info", timeout=60).json()["internal_states"]
    return sum(s["cache_hit_tokens"] for s in states), sum(s["cache_query_tokens"] for s in states)


def run_one(url: str, bench_args: list[str]) -> dict[str, Any]:
    assert httpx.post(f"{url}/flush_cache", timeout=60).status_code == 200  # the warm-up's prefix too
    hit0, query0 = cache_counters(url)
    metrics = bench_serving(["--base-url", url, "--warmup-requests", "0", "--disable-tqdm", *bench_args])
    hit1, query1 = cache_counters(url)
    return {
        "cached_share": (hit1 - hit0) / max(query1 - query0, 1),
        "output_throughput": metrics.output_throughput,
        "request_throughput": metrics.request_throughput,
        "median_ttft_ms": metrics.median_ttft_ms,
        "completed": metrics.completed,
        "failed": metrics.failed,
    }


def dispatch(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    bench = [
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "8", "--gsp-prompts-per-group", "8",
        "--gsp-system-prompt-len", str(args.prefix_len), "--gsp-question-len", str(args.question_len),
        "--gsp-output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
        "--seed", str(args.seed),
    ]  # fmt: skip
    rows = []
    for method in ("cache_aware", "round_robin"):
        flags = ["--dp-size", "2", "--load-balance-method", method, *args.server_flags]
        with server(args.model, flags) as url:
            rows.append((f"dp=2 {method}", run_one(url, bench)))
    return rows


def scale(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    bench = [
        "--dataset-name", "random-ids", "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.question_len), "--random-output-len", str(args.output_len),
        "--max-concurrency", "64", "--seed", str(args.seed),
    ]  # fmt: skip
    rows = []
    for name, dp in (("dp=1 (2 threads)", 1), ("dp=2 (1 thread each)", 2)):
        flags = ["--dp-size", str(dp), "--cpu-threads", "2", *args.server_flags]
        with server(args.model, flags) as url:
            rows.append((name, run_one(url, bench)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["dispatch", "scale"])
    p.add_argument("--model", default="default", help="Model folder (default: the built-in model).")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16, help="dispatch: --max-concurrency")
    p.add_argument("--num-prompts", type=int, default=128, help="scale: prompts")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--server-flags", default="--max-total-tokens 3584", help="Extra launch_server flags (one string)."
    )
    args = p.parse_args()
    args.server_flags = args.server_flags.split()
    rows = dispatch(args) if args.mode == "dispatch" else scale(args)
    print(f"\n{' '.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])}")
    print("| run | cached-token share | output tok/s | req/s | median TTFT ms | completed | failed |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['cached_share']:.3f} | {r['output_throughput']:.1f} | "
            f"{r['request_throughput']:.2f} | {r['median_ttft_ms']:.0f} | {r['completed']} | {r['failed']} |"
        )


if __name__ == "__main__":
    main()
