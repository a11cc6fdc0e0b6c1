"""Online serving benchmark: replay a dataset against a running server and report latency/throughput.

    python -m radixserve.bench_serving --backend radixserve --dataset-name random-ids \\
        --num-prompts 64 --random-input-len 128 --random-output-len 128 --max-concurrency 16

Works against radixserve's native /generate and any OpenAI-compatible server (SGLang, vLLM,
llama.cpp). Each request opens its own connection and, unless --seed is given, each run draws
fresh random prompts, so server-side prompt caches cannot answer a repeat of an earlier run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import httpx
import numpy as np
from tqdm.asyncio import tqdm

from radixserve.benchmark_utils import datasets as ds
from radixserve.benchmark_utils.backends import BACKENDS, Backend, RequestFuncInput, get_backend, send_request
from radixserve.benchmark_utils.metrics import (
    BenchmarkMetrics,
    RequestFuncOutput,
    calculate_metrics,
    format_report,
)

logger = logging.getLogger("radixserve.bench_serving")

# Long generations on a CPU server can take many minutes; only a wedged server should hit this.
REQUEST_TIMEOUT_S = 6 * 3600
DEFAULT_VOCAB_SIZE = 32000


# ----------------------------------------------------------------------------- arrivals
def arrival_times(n: int, request_rate: float, rng: np.random.Generator) -> list[float]:
    """Send offsets (seconds from the start) of a Poisson process; all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    gaps = rng.exponential(1.0 / request_rate, size=max(n - 1, 0))
    # The first request goes out at t=0; the schedule is absolute so sleeps never accumulate drift.
    return [0.0, *np.cumsum(gaps).tolist()][:n]


# ----------------------------------------------------------------------------- server discovery
@dataclass
class ServerInfo:
    model_id: str | None = None
    model_path: str | None = None
    vocab_size: int | None = None


def _get_json(client: httpx.Client, url: str) -> dict[str, Any] | None:
    try:
        resp = client.get(url)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def fetch_server_info(base_url: str) -> ServerInfo:
    """Model name, local model path and vocabulary size as far as the server tells (all optional)."""
    info = ServerInfo()
    with httpx.Client(timeout=10.0) as client:
        native = _get_json(client, f"{base_url}/get_model_info") or {}
        models = _get_json(client, f"{base_url}/v1/models") or {}
    cards = models.get("data") or [{}]
    card = cards[0] if isinstance(cards[0], dict) else {}
    info.model_id = card.get("id")
    info.model_path = (
        native.get("tokenizer_path") or native.get("model_path") or card.get("root") or card.get("id")
    )
    # llama.cpp reports the vocabulary under meta.n_vocab.
    info.vocab_size = native.get("vocab_size") or (card.get("meta") or {}).get("n_vocab")
    return info


def load_tokenizer(spec: str | None, info: ServerInfo) -> Any | None:
    """--tokenizer PATH, 'none', or (unset) the folder the server says its model lives in."""
    if spec and spec.lower() == "none":
        return None
    from transformers import AutoTokenizer

    if spec:
        return AutoTokenizer.from_pretrained(spec)
    path = info.model_path
    if not path or not os.path.isdir(path):
        logger.warning("No local tokenizer folder from the server (%r); using token-id prompts only", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        logger.warning("Could not load a tokenizer from %s (%s); using token-id prompts only", path, e)
        return None


# ----------------------------------------------------------------------------- dataset
def token_choices(tokenizer: Any | None, info: ServerInfo, vocab_size: int | None) -> list[int]:
    if tokenizer is not None:
        size = min(vocab_size or tokenizer.vocab_size, tokenizer.vocab_size)  # ids it can decode
        return ds.vocab_choices(size, tokenizer.all_special_ids)
    size = vocab_size or info.vocab_size
    if size is None:
        logger.warning(
            "Vocabulary size unknown; drawing ids below %d (set --random-vocab-size)", DEFAULT_VOCAB_SIZE
        )
        size = DEFAULT_VOCAB_SIZE
    return ds.vocab_choices(int(size))


def build_dataset(
    args: argparse.Namespace, rng: random.Random, tokenizer: Any | None, info: ServerInfo, backend: Backend
) -> list[ds.DatasetRow]:
    as_text = not backend.accepts_token_ids
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file)")
        return ds.load_sharegpt(args.dataset_path, args.num_prompts, tokenizer, rng, args.sharegpt_output_len)
    choices = token_choices(tokenizer, info, args.random_vocab_size)
    return ds.synthetic_dataset(args, rng, choices, tokenizer, as_text)


def warmup_row(row: ds.DatasetRow) -> ds.DatasetRow:
    """The first prompt reversed: same size, but not a prefix-cache hit for the measured request."""
    prompt = row.prompt[::-1] if isinstance(row.prompt, list) else " ".join(reversed(row.prompt.split(" ")))
    return ds.DatasetRow(prompt=prompt, prompt_len=row.prompt_len, output_len=min(row.output_len, 16))


# ----------------------------------------------------------------------------- run
@dataclass
class RunConfig:
    api_url: str
    model: str
    stream: bool
    request_rate: float
    max_concurrency: int | None
    warmup_requests: int
    disable_tqdm: bool
    extra_body: dict[str, Any] = field(default_factory=dict)


def _request_input(cfg: RunConfig, row: ds.DatasetRow) -> RequestFuncInput:
    return RequestFuncInput(
        api_url=cfg.api_url,
        prompt=row.prompt,
        prompt_len=row.prompt_len,
        output_len=row.output_len,
        model=cfg.model,
        stream=cfg.stream,
        extra_body=cfg.extra_body,
    )


def new_session() -> aiohttp.ClientSession:
    # force_close: a fresh TCP connection per request (llama.cpp drops reused keep-alive sockets);
    # limit=0: the connector must not cap concurrency below --max-concurrency.
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


async def _warmup(
    session: aiohttp.ClientSession, backend: Backend, cfg: RunConfig, row: ds.DatasetRow
) -> None:
    if cfg.warmup_requests <= 0:
        return
    inp = _request_input(cfg, warmup_row(row))
    outs = await asyncio.gather(*(send_request(session, backend, inp) for _ in range(cfg.warmup_requests)))
    if not any(o.success for o in outs):
        raise SystemExit(f"Warm-up failed; is the server up at {cfg.api_url}? {outs[0].error}")


async def run_benchmark(
    cfg: RunConfig, backend: Backend, rows: list[ds.DatasetRow], times: list[float]
) -> tuple[list[RequestFuncOutput], float]:
    """Send `rows[i]` at `times[i]` (bounded by max_concurrency); returns outputs and duration."""
    async with new_session() as session:
        await _warmup(session, backend, cfg, rows[0])
        limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        pbar = tqdm(total=len(rows), disable=cfg.disable_tqdm)
        start = time.perf_counter()

        async def one(row: ds.DatasetRow) -> RequestFuncOutput:
            if limit is not None:
                async with limit:
                    return await timed(row)
            return await timed(row)

        async def timed(row: ds.DatasetRow) -> RequestFuncOutput:
            sent = time.perf_counter() - start
            out = await send_request(session, backend, _request_input(cfg, row))
            out.start_time = sent
            pbar.update(1)
            return out

        tasks = []
        for row, at in zip(rows, times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(row)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()
    return list(outputs), duration


# ----------------------------------------------------------------------------- report
def write_record(
    path: str,
    args: argparse.Namespace,
    seed: int,
    metrics: BenchmarkMetrics,
    outputs: list[RequestFuncOutput],
) -> None:
    """Append one JSON line: every metric, the arguments, the seed actually used, and per request
    (in dataset order, as SGLang's records have them) its send time, TTFT, latency and lengths."""
    record = {"timestamp": time.time(), **asdict(metrics), "seed": seed, "args": vars(args)}
    record["errors"] = metrics.errors[:20]  # keep the line short when a whole run fails
    record["start_times"] = [round(o.start_time, 6) for o in outputs]
    record["ttfts"] = [round(o.ttft, 6) if o.success else None for o in outputs]
    record["latencies"] = [round(o.latency, 6) if o.success else None for o in outputs]
    record["itls"] = [[round(gap, 6) for gap in o.itl] if o.success else None for o in outputs]
    record["input_lens"] = [o.prompt_len for o in outputs]
    record["output_lens"] = [o.output_len for o in outputs]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="radixserve")
    p.add_argument("--base-url", default=None, help="Server URL; overrides --host/--port.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="Model name for OpenAI APIs (default: the server's first).")
    p.add_argument(
        "--tokenizer", default=None, help="Local tokenizer folder, or 'none' (default: ask the server)."
    )
    p.add_argument(
        "--dataset-name", choices=["random-ids", "generated-shared-prefix", "sharegpt"], default="random-ids"
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file for --dataset-name sharegpt.")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="Fixed output length for sharegpt.")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="Lengths drawn from [len*ratio, len]."
    )
    p.add_argument(
        "--random-vocab-size", type=int, default=None, help="Draw ids below this (default: tokenizer/server)."
    )
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second; inf = burst."
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--seed", type=int, default=None, help="Default: a fresh seed per run (defeats prompt caches)."
    )
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--output-file", default=None, help="Append one JSONL record of the results.")
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body.")
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> BenchmarkMetrics:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per discovery GET is noise
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    backend = get_backend(args.backend)
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}

    info = fetch_server_info(base_url)
    tokenizer = load_tokenizer(args.tokenizer, info)
    rows = build_dataset(args, random.Random(seed), tokenizer, info, backend)
    times = arrival_times(len(rows), args.request_rate, np.random.default_rng(seed))
    cfg = RunConfig(
        api_url=base_url + backend.path,
        model=args.model or info.model_id or "default",
        stream=not args.disable_stream,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        warmup_requests=args.warmup_requests,
        disable_tqdm=args.disable_tqdm,
        extra_body=extra,
    )
    print(
        f"{args.backend} @ {cfg.api_url}: {len(rows)} prompts of {args.dataset_name}, seed {seed}",
        file=sys.stderr,
    )
    outputs, duration = asyncio.run(run_benchmark(cfg, backend, rows, times))

    metrics = calculate_metrics(outputs, duration)
    header = {
        "Backend": args.backend,
        "Traffic request rate": args.request_rate,
        "Max request concurrency": args.max_concurrency or "not set",
    }
    print(format_report(metrics, header))
    if args.output_file:
        write_record(args.output_file, args, seed, metrics, outputs)
    return metrics


if __name__ == "__main__":
    main()
