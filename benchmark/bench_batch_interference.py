"""Does a running OpenAI batch raise an interactive request's time to first token?

    python benchmark/bench_batch_interference.py                      # the built-in model
    python benchmark/bench_batch_interference.py --model PATH --requests 20

For each mode (priority scheduling off, then on; a fresh server each), it sends `--requests`
streaming chat requests one after the other and times each one's first token: first on the idle
server, then while a batch of long requests (ignore_eos, so it runs throughout) is in progress.
It prints the median and p90 TTFT of both, and their ratio; the goal (issue 42) is a ratio of at
most 1.10. The batch is cancelled at the end of each mode. Not a test: the numbers depend on the
machine; docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time

import httpx
from peers.process import radixserve_server

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 12 times 7?",
    "Say hello in Spanish.",
    "What is the boiling point of water?",
    "Name a planet.",
]


def server(model: str | None, flags: list[str]) -> contextlib.AbstractContextManager[str]:
    return radixserve_server(model, flags, "bench_batch_interference")


def ttft_s(client: httpx.Client, question: str, max_tokens: int) -> float:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter() - start
                for _ in lines:  # read to the end, as a client would
                    pass
                return first
    raise RuntimeError("the stream ended without a token")


def ttfts(client: httpx.Client, n: int, max_tokens: int) -> list[float]:
    return [ttft_s(client, QUESTIONS[i % len(QUESTIONS)], max_tokens) for i in range(n)]


def start_batch(client: httpx.Client, lines: int, tokens: int) -> str:
    body = {"model": "default", "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    rows = [
        {
            "custom_id": f"b{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**body, "prompt": f"Story {i}:"},
        }
        for i in range(lines)
    ]
    data = "\n".join(json.dumps(r) for r in rows).encode()
    file = client.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"})
    file.raise_for_status()
    create = {"input_file_id": file.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = client.post("/v1/batches", json=create).json()
    deadline = time.monotonic() + 120
    while client.get(f"/v1/batches/{batch['id']}").json()["status"] != "in_progress":
        assert time.monotonic() < deadline, "the batch did not start"
        time.sleep(0.1)
    time.sleep(2.0)  # its first lines are decoding
    return batch["id"]


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": 1000 * statistics.median(ordered),
        "p90_ms": 1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def run_mode(args: argparse.Namespace, flags: list[str]) -> dict[str, object]:
    with (
        server(args.model, [*flags, *args.server_flags.split()]) as url,
        httpx.Client(base_url=url, timeout=600) as c,
    ):
        ttfts(c, 2, args.max_tokens)  # warm the caches and the code paths
        idle = ttfts(c, args.requests, args.max_tokens)
        batch_id = start_batch(c, args.batch_lines, args.batch_tokens)
        busy = ttfts(c, args.requests, args.max_tokens)
        state = c.get(f"/v1/batches/{batch_id}").json()
        c.post(f"/v1/batches/{batch_id}/cancel")
    assert state["status"] == "in_progress", (
        "the batch ended before the measurement did: raise --batch-tokens"
    )
    idle_s, busy_s = summary(idle), summary(busy)
    return {
        "idle": idle_s,
        "with_batch": busy_s,
        "median_ratio": busy_s["median_ms"] / idle_s["median_ms"],
        "batch_lines_done_meanwhile": state["request_counts"]["completed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="Model path (default: the built-in model).")
    parser.add_argument("--requests", type=int, default=12, help="Interactive requests per phase.")
    parser.add_argument("--max-tokens", type=int, default=8, help="Tokens per interactive answer.")
    parser.add_argument("--batch-lines", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=1024, help="Tokens per batch line (ignore_eos).")
    parser.add_argument(
        "--server-flags", default="--max-total-tokens 16384", help="Extra launch_server flags."
    )
    args = parser.parse_args()
    results = {}
    for name, flags in (("priority off", []), ("priority on", ["--enable-priority-scheduling"])):
        results[name] = run_mode(args, flags)
        print(name, json.dumps(results[name]), flush=True)
    print("| mode | idle median / p90 TTFT (ms) | with a batch median / p90 (ms) | median ratio |")
    print("|---|---|---|---|")
    for name, r in results.items():
        idle, busy = r["idle"], r["with_batch"]
        print(
            f"| {name} | {idle['median_ms']:.0f} / {idle['p90_ms']:.0f} | "
            f"{busy['median_ms']:.0f} / {busy['p90_ms']:.0f} | {r['median_ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
