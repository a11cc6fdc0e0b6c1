"""Many LoRA adapters in one batch vs the base model (issue 39's benchmark).

    python benchmark/bench_lora.py                                  # the built-in model, C=16 and C=64
    python benchmark/bench_lora.py --concurrency 2 --input-len 8 --output-len 4 --num-adapters 2  # smoke

Writes `--num-adapters` random rank-`--rank` adapters of q/k/v/o/gate/up/down for the model (with
radixserve.testing.tiny_lora, the writer the tests use: peft's own save_pretrained), then for
each concurrency C sends the same kind of workload (`--waves` x C requests of `--input-len`
random token ids, `--output-len` tokens each, ignore_eos; at most C in flight) to:

- base: a server without --enable-lora (the base model alone);
- base on the LoRA server: the same requests without an adapter to the LoRA server;
- mixed: the LoRA server, the requests spread uniformly over the adapters (request i: adapter
  i % N), all in flight together;
- one at a time: the same requests as mixed, but each adapter's requests run to completion
  before the next adapter's start (what a server that cannot mix adapters in a batch gets).

Prints output tok/s per case and C, the ratio to base (issue 39's goal: mixed >= 0.8x base), and
the CPU. Not a test: the numbers depend on the machine (docs/benchmarks.md records runs).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import tempfile
import time
from pathlib import Path

import httpx
from peers.process import radixserve_server

from radixserve.testing.tiny_lora import TINY_ADAPTERS, make_tiny_adapter

ADAPTER_KIND = "all16"  # rank 16, all seven projections (TINY_ADAPTERS)
VOCAB_LOW, VOCAB_HIGH = 100, 40000  # random prompt ids inside every supported tokenizer's range


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_adapters(base_path: str, num: int, root: Path) -> dict[str, str]:
    """num random adapters of ADAPTER_KIND for the model at base_path, {name: folder}."""
    return {
        f"a{i}": str(make_tiny_adapter(base_path, ADAPTER_KIND, root / f"a{i}", seed=i)) for i in range(num)
    }


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """Distinct random prompts: no two share a cached prefix."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(num)]


async def _send(
    client: httpx.AsyncClient, gate: asyncio.Semaphore, ids: list[int], output_len: int, lora: str | None
) -> int:
    body: dict[str, object] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
    }
    if lora is not None:
        body["lora_path"] = lora
    async with gate:
        resp = await client.post("/generate", json=body)
    resp.raise_for_status()
    return int(resp.json()["meta_info"]["completion_tokens"])


async def _run(url: str, groups: list[list[tuple[list[int], str | None]]], c: int, output_len: int) -> float:
    """Output tok/s over the groups, run one after the other, each with at most c in flight."""
    limits = httpx.Limits(max_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        gate = asyncio.Semaphore(c)
        tokens, start = 0, time.perf_counter()
        for group in groups:
            done = await asyncio.gather(*(_send(client, gate, ids, output_len, lora) for ids, lora in group))
            tokens += sum(done)
        return tokens / (time.perf_counter() - start)


def measure(url: str, groups: list[list[tuple[list[int], str | None]]], c: int, output_len: int) -> float:
    return asyncio.run(_run(url, groups, c, output_len))


def warm(url: str, names: list[str | None], input_len: int) -> None:
    """One short request per adapter (and the base model): slots loaded, code paths compiled."""
    groups = [[(ids, n) for ids, n in zip(prompts(len(names), input_len, seed=-1), names)]]
    measure(url, groups, len(names), 2)


def lora_cases(url: str, names: list[str], c: int, args: argparse.Namespace) -> dict[str, float]:
    num = args.waves * c
    ps = prompts(num, args.input_len, seed=c)
    mixed = [(ids, names[i % len(names)]) for i, ids in enumerate(ps)]
    one_at_a_time = [[r for r in mixed if r[1] == n] for n in names]
    return {
        "base on the LoRA server": measure(url, [[(ids, None) for ids in ps]], c, args.output_len),
        f"mixed: {len(names)} adapters": measure(url, [mixed], c, args.output_len),
        "one adapter at a time": measure(url, one_at_a_time, c, args.output_len),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model path (default: the built-in model).")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--waves", type=int, default=4, help="Requests per concurrency level: waves x C.")
    p.add_argument("--server-flags", default="", help="Extra launch_server flags for both servers.")
    args = p.parse_args()
    rank = TINY_ADAPTERS[ADAPTER_KIND][0]
    if args.model is None:
        from radixserve.model_loader.default_model import ensure_default_model

        base_path = ensure_default_model()
    else:
        base_path = args.model
    extra = args.server_flags.split()
    results: dict[str, dict[int, float]] = {}
    with radixserve_server(args.model, extra, "bench_lora_base") as url:
        warm(url, [None], args.input_len)
        for c in args.concurrency:
            ps = [[(ids, None) for ids in prompts(args.waves * c, args.input_len, seed=c)]]
            results.setdefault("base (no --enable-lora)", {})[c] = measure(url, ps, c, args.output_len)
            print(f"base C={c}: {results['base (no --enable-lora)'][c]:.1f} tok/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        adapters = write_adapters(base_path, args.num_adapters, Path(tmp))
        names = list(adapters)
        flags = ["--lora-paths", *(f"{n}={path}" for n, path in adapters.items())]
        flags += ["--max-loras-per-batch", str(args.num_adapters), *extra]
        with radixserve_server(args.model, flags, "bench_lora_adapters") as url:
            warm(url, [None, *names], args.input_len)
            for c in args.concurrency:
                for case, tok_s in lora_cases(url, names, c, args).items():
                    results.setdefault(case, {})[c] = tok_s
                    print(f"{case} C={c}: {tok_s:.1f} tok/s", flush=True)
    print_table(results, args, rank)


def print_table(results: dict[str, dict[int, float]], args: argparse.Namespace, rank: int) -> None:
    base = results["base (no --enable-lora)"]
    print(
        f"\n{cpu_name()}; {args.num_adapters} random rank-{rank} adapters (q/k/v/o/gate/up/down); "
        f"{args.input_len} in / {args.output_len} out; {args.waves} x C requests; output tok/s (x base)"
    )
    print("| case | " + " | ".join(f"C={c}" for c in args.concurrency) + " |")
    print("|---|" + "---|" * len(args.concurrency))
    for case, by_c in results.items():
        cells = [f"{by_c[c]:.1f} ({by_c[c] / base[c]:.2f}x)" for c in args.concurrency]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
