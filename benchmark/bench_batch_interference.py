"""Does a running OpenAI batch raise an interactive request's time to first token?

    python benchmark/bench_batch_interference.py                      # the built-in model
    python benchmark/bench_batch_interference.py --model PATH --requests 20
    python benchmark/bench_batch_interference.py --baseline-tree /tmp/main   # A/B: that tree, then this

For each mode (priority scheduling off, then on; a fresh server each), it sends `--requests`
streaming chat requests one after the other and times each one's first token: first on the idle
server, then while a batch of long requests (ignore_eos, so it runs throughout) is in progress.
Each request waits a random 0..--jitter-ms first (seeded; both phases), so that it arrives at a
random moment of the batch's decode step as an independent client's would: sent right after the
previous answer, it would always arrive just after the step that carried that answer's last token
had been followed by a new one, and wait that whole step (docs/benchmarks.md, "Batch API").
--baseline-tree DIR runs every mode on DIR's radixserve first (DIR/python first on PYTHONPATH),
then on this one, for an A/B in one run.
It prints the median and p90 TTFT of both, and their ratio; the goal (issue 42) is a ratio of at
most 1.10. The batch is cancelled at the end of each mode. Not a test: the numbers depend on the
machine; docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from peers.process import ServerProcess, free_port

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 12 times 7?",
    "Say hello in Spanish.",
    "What is the boiling point of water?",
    "Name a planet.",
]


@contextlib.contextmanager
def server(model: str | None, flags: list[str], tree: Path | None) -> Iterator[str]:
    """A server of this tree's radixserve, or of `tree`'s (its python/ first on PYTHONPATH)."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), "--log-level", "warning"]
    if model:
        cmd += ["--model-path", model]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(tree.resolve() / "python"), env.get("PYTHONPATH")])
        )
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / f"bench_batch_interference_{port}.log"
    with ServerProcess("radixserve", [*cmd, *flags], log, url, env=env) as proc:
        proc.wait_healthy(600)
        yield url


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


def ttfts(client: httpx.Client, n: int, max_tokens: int, rng: random.Random, jitter_s: float) -> list[float]:
    out = []
    for i in range(n):
        time.sleep(rng.uniform(0.0, jitter_s))  # a random phase against the batch's steps
        out.append(ttft_s(client, QUESTIONS[i % len(QUESTIONS)], max_tokens))
    return out


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


def run_mode(args: argparse.Namespace, flags: list[str], tree: Path | None) -> dict[str, object]:
    rng, jitter_s = random.Random(0), args.jitter_ms / 1000
    with (
        server(args.model, [*flags, *args.server_flags.split()], tree) as url,
        httpx.Client(base_url=url, timeout=600) as c,
    ):
        ttfts(c, 2, args.max_tokens, rng, 0.0)  # warm the caches and the code paths
        idle = ttfts(c, args.requests, args.max_tokens, rng, jitter_s)
        batch_id = start_batch(c, args.batch_lines, args.batch_tokens)
        busy = ttfts(c, args.requests, args.max_tokens, rng, jitter_s)
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
    parser.add_argument(
        "--jitter-ms", type=float, default=50.0, help="Random wait before each request (0: back to back)."
    )
    parser.add_argument("--baseline-tree", type=Path, default=None, help="Also run this checkout, first.")
    args = parser.parse_args()
    trees = (
        [(f"{args.baseline_tree} ", args.baseline_tree), ("", None)] if args.baseline_tree else [("", None)]
    )
    results = {}
    for name, flags in (("priority off", []), ("priority on", ["--enable-priority-scheduling"])):
        for label, tree in trees:
            results[label + name] = run_mode(args, flags, tree)
            print(label + name, json.dumps(results[label + name]), flush=True)
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
