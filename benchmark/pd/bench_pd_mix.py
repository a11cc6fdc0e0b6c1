"""Prefill-heavy mix against one URL (a PD router or a colocated server): short chats with a few
2k-token prompts among them. Reports TTFT, inter-token latency (ITL) p50/p99 of the short
requests, throughput, and (for a PD pair) the prefill server's KV transfer rate.

    python benchmark/pd/bench_pd_mix.py --url http://127.0.0.1:30000 [--prefill-url http://P]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    kind: str
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def one(client: httpx.AsyncClient, url: str, kind: str, ids: list[int], out_len: int) -> Outcome:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    res, start = Outcome(kind), time.perf_counter()
    last, seen = start, 0
    try:
        async with client.stream("POST", f"{url}/generate", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                n = len(json.loads(line[6:])["output_ids"])
                now = time.perf_counter()
                if seen == 0:
                    res.ttft = now - start
                elif n > seen:
                    res.itls.extend([(now - last) / (n - seen)] * (n - seen))
                last, seen = now, n
    except httpx.HTTPError as exc:
        res.error = repr(exc)
    res.tokens = seen
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q / 100 * len(values)), len(values) - 1)]


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    plan = []
    for i in range(args.num_requests):
        long = i % args.long_every == args.long_every // 2
        n_in = args.long_input if long else args.short_input
        plan.append(
            (
                "long" if long else "short",
                [rng.randrange(100, 40000) for _ in range(n_in)],
                args.long_output if long else args.short_output,
            )
        )
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for kind, ids, out in plan:
            tasks.append(asyncio.create_task(one(client, args.url, kind, ids, out)))
            await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    short = [r for r in results if r.kind == "short" and not r.error]
    longs = [r for r in results if r.kind == "long" and not r.error]
    itl = [x for r in short for x in r.itls]
    report = {
        "requests": len(results),
        "errors": len(errors),
        "duration_s": round(duration, 2),
        "output_tok_per_s": round(sum(r.tokens for r in results) / duration, 2),
        "ttft_short_p50_ms": round(1000 * pct([r.ttft for r in short], 50), 1),
        "ttft_short_p99_ms": round(1000 * pct([r.ttft for r in short], 99), 1),
        "ttft_long_p50_ms": round(1000 * pct([r.ttft for r in longs], 50), 1),
        "itl_short_p50_ms": round(1000 * pct(itl, 50), 1),
        "itl_short_p99_ms": round(1000 * pct(itl, 99), 1),
        "itl_short_max_ms": round(1000 * max(itl), 1) if itl else None,
        "itl_short_mean_ms": round(1000 * statistics.mean(itl), 1) if itl else None,
    }
    if args.prefill_url:
        s = httpx.get(f"{args.prefill_url}/get_server_info", timeout=30).json()["internal_states"][0]
        report.update(
            kv_transfers=s["kv_transfers"],
            kv_transfer_mb=round(s["kv_transfer_bytes"] / 1e6, 1),
            kv_transfer_gb_per_s=round(s["kv_transfer_gb_per_s"], 3),
        )
    if errors:
        report["first_error"] = errors[0]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--prefill-url", default=None, help="PD only: read the KV transfer counters there")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--long-every", type=int, default=6, help="one 2k-token prompt every N requests")
    p.add_argument("--short-input", type=int, default=64)
    p.add_argument("--short-output", type=int, default=64)
    p.add_argument("--long-input", type=int, default=2000)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main(p.parse_args()))
