"""Long-document conversations with and without the host KV tier (issue 41).

    python benchmark/bench_hicache.py                     # 32 conversations, 2000-token documents
    python benchmark/bench_hicache.py --conversations 8 --doc-len 1000 --max-total-tokens 4096
    python benchmark/bench_hicache.py --modes restart --conversations 4   # warm L3 after a restart

Each conversation is a distinct random document (token ids) followed by `--turns` questions; turn
t's prompt is the document plus questions 0..t, so each turn extends the previous one. The
conversations are replayed turn by turn (every conversation's turn 0, then every turn 1, ...) by
`--concurrency` clients, so by the time a conversation comes back its document has been pushed
out of a KV pool (`--max-total-tokens`) that holds only a few documents. Each mode gets a fresh
server: radix cache only, then `--enable-hierarchical-cache`. It prints TTFT p50/p90 of the
follow-up turns (turn 0 is a cold prefill in both modes), output tok/s, and the tier counters.
The `restart` mode measures the L3 tier: a server with `--hicache-storage-backend file` (a fresh
directory, `--page-size 16`) answers each conversation's first turn cold, one at a time, and writes
its pages to disk; a second server over the same directory (an empty tree) answers the same
prompts again with `--hicache-storage-prefetch-policy wait_complete`. It prints the TTFT of both.
Not a test: the numbers depend on the machine; docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import threading
import time

import httpx
from peers.process import radixserve_server


def server(model: str | None, flags: list[str]) -> contextlib.AbstractContextManager[str]:
    return radixserve_server(model, flags, "bench_hicache")


def conversations(n: int, doc_len: int, turns: int, seed: int) -> list[list[list[int]]]:
    """[conversation][turn] -> prompt token ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(100, 40000) for _ in range(doc_len)]
        conv = []
        for _ in range(turns):
            prompt = prompt + [rng.randrange(100, 40000) for _ in range(24)]
            conv.append(prompt)
        out.append(conv)
    return out


def one_request(client: httpx.Client, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, latency s, output tokens) of one streamed /generate."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    first, last = None, None
    with client.stream("POST", "/generate", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first if first is not None else time.perf_counter() - start
                last = json.loads(line[6:])
    assert first is not None and last is not None, "the stream ended without output"
    return first, time.perf_counter() - start, last["meta_info"]["completion_tokens"]


def replay(url: str, convs: list[list[list[int]]], concurrency: int, max_tokens: int) -> dict[str, object]:
    jobs = [(t, c) for t in range(len(convs[0])) for c in range(len(convs))]
    lock, results = threading.Lock(), []

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=1800) as client:
            while True:
                with lock:
                    if not jobs:
                        return
                    turn, conv = jobs.pop(0)
                ttft, latency, tokens = one_request(client, convs[conv][turn], max_tokens)
                with lock:
                    results.append((turn, ttft, latency, tokens))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    duration = time.perf_counter() - start
    follow = sorted(r[1] for r in results if r[0] > 0)
    cold = sorted(r[1] for r in results if r[0] == 0)
    with httpx.Client(base_url=url, timeout=60) as client:
        state = client.get("/get_server_info").json()["internal_states"][0]
    return {
        "duration_s": round(duration, 1),
        "output_tok_s": round(sum(r[3] for r in results) / duration, 2),
        "ttft_follow_up_p50_s": round(statistics.median(follow), 3),
        "ttft_follow_up_p90_s": round(follow[min(len(follow) - 1, int(0.9 * len(follow)))], 3),
        "ttft_first_turn_p50_s": round(statistics.median(cold), 3),
        "cache_hit_rate": round(state["cache_hit_rate"], 3),
        "hicache": state.get("hicache"),
    }


def sequential_ttfts(url: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    with httpx.Client(base_url=url, timeout=1800) as client:
        return [one_request(client, ids, max_tokens)[0] for ids in prompts]


def hicache_state(url: str) -> dict[str, object]:
    with httpx.Client(base_url=url, timeout=60) as client:
        return client.get("/get_server_info").json()["internal_states"][0]["hicache"]


def wait_written(url: str, pages: int, limit_s: float = 600) -> None:
    """Until the backup thread has written ``pages`` page files (or the limit passed)."""
    deadline = time.monotonic() + limit_s
    while hicache_state(url)["storage_written_pages"] < pages and time.monotonic() < deadline:
        time.sleep(0.5)


def restart(
    model: str | None, base: list[str], convs: list[list[list[int]]], max_tokens: int
) -> dict[str, object]:
    """First turns cold on one server, then again on a restarted one over the same L3 directory."""
    prompts = [conv[0] for conv in convs]
    page_size = 16
    flags = [
        *base,
        "--enable-hierarchical-cache",
        "--page-size",
        str(page_size),
        "--hicache-storage-backend",
        "file",
    ]
    with tempfile.TemporaryDirectory(prefix="bench_hicache_l3_") as directory:
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = directory  # the servers inherit it
        with server(model, flags) as url:
            cold = sequential_ttfts(url, prompts, max_tokens)
            wait_written(url, sum((len(p) - 1) // page_size for p in prompts))
            written = hicache_state(url)
        with server(model, [*flags, "--hicache-storage-prefetch-policy", "wait_complete"]) as url:
            warm = sequential_ttfts(url, prompts, max_tokens)
            state = hicache_state(url)
    return {
        "ttft_cold_p50_s": round(statistics.median(cold), 3),
        "ttft_warm_l3_p50_s": round(statistics.median(warm), 3),
        "ratio": round(statistics.median(warm) / statistics.median(cold), 3),
        "cold_s": [round(t, 3) for t in cold],
        "warm_s": [round(t, 3) for t in warm],
        "written": {k: written[k] for k in ("storage_files", "storage_bytes", "storage_write_time_s")},
        "read": {k: state[k] for k in ("storage_hit_tokens", "storage_read_bytes", "storage_read_time_s")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="Model path (default: the built-in model).")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--doc-len", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=5, help="The first turn and its follow-ups.")
    parser.add_argument("--max-tokens", type=int, default=16, help="Output tokens per turn.")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="The device KV pool (L1).")
    parser.add_argument("--hicache-ratio", type=float, default=6.0)
    parser.add_argument("--server-flags", default="", help="Extra flags for both servers.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes",
        default="radix,hicache",
        help="Which servers to run, in order: radix, hicache, restart (L3).",
    )
    args = parser.parse_args()
    convs = conversations(args.conversations, args.doc_len, args.turns, args.seed)
    base = ["--max-total-tokens", str(args.max_total_tokens), *args.server_flags.split()]
    modes = {
        "radix": base,
        "hicache": [*base, "--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)],
    }
    report = {}
    for name in args.modes.split(","):
        if name == "restart":
            report[name] = restart(args.model, base, convs, args.max_tokens)
            print(name, json.dumps(report[name]), flush=True)
            continue
        with server(args.model, modes[name]) as url:
            report[name] = replay(url, convs, args.concurrency, args.max_tokens)
        print(name, json.dumps(report[name]), flush=True)
    if "radix" in report and "hicache" in report:
        ratio = report["hicache"]["ttft_follow_up_p50_s"] / report["radix"]["ttft_follow_up_p50_s"]
        print(json.dumps({"ttft_follow_up_p50_ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
