"""Soak test: RSS of every server process over time under a mixed load.

Starts a server (or attaches to one with --url), runs a mix of requests from a few client threads
for --duration seconds, samples the resident set size of the HTTP/TokenizerManager process and of
each child (scheduler, detokenizer) every --interval seconds, then calls /flush_cache and samples
once more. The mix: chat (streaming and not), completions (with echo + logprobs), n=2, json_schema
chat (a fresh schema every --schema-every requests, so the grammar compile cache sees new keys),
aborts of running requests and clients that disconnect mid-stream; prompts get 0-40 filler words
so their lengths (prefill shapes) vary as in real traffic.

    python benchmark/soak_rss.py --duration 240                      # the built-in model
    python benchmark/soak_rss.py --model /path/to/model --duration 120 --concurrency 6
    python benchmark/soak_rss.py --url http://127.0.0.1:30000 --duration 60

The report gives, for each process, its RSS and its anonymous RSS ("anon": private heap and
tensors, Linux's RssAnon) at start (after warm-up), at the end, after the flush, and the growth
rate (least-squares slope over the second half of the run) per minute and per 1000 completed
requests (comparable between runs on a machine whose speed varies): a leak keeps a positive slope
however long the run, a cache that fills up levels off. RSS also counts shared file pages (torch's
libraries, ~100 MiB), which the kernel drops and reloads under memory pressure from other
processes; anon does not move with them, so judge growth by anon.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from peers.process import ServerProcess, http_status

MIB = 1 << 20


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss: dict[str, float]  # process label -> RSS in MiB
    anon: dict[str, float]  # process label -> anonymous RSS in MiB (no shared file pages)
    done: int = 0  # requests completed (ok or not) so far


@dataclass
class LoadStats:
    counts: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, ok: bool) -> None:
        with self.lock:
            target = self.counts if ok else self.errors
            target[kind] = target.get(kind, 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.counts.values()) + sum(self.errors.values())


# ---------------------------------------------------------------------------------------- processes
def server_processes(root_pid: int) -> dict[str, psutil.Process]:
    """Label the server's processes: 'http' (the root), then its spawned children in start order
    (scheduler-0, detokenizer: the order launch_subprocesses starts them)."""
    root = psutil.Process(root_pid)
    spawned = [p for p in root.children(recursive=True) if any("spawn_main" in part for part in p.cmdline())]
    spawned.sort(key=lambda p: p.create_time())
    names = ["scheduler", "detokenizer"] + [f"child{i}" for i in range(2, len(spawned))]
    return {"http": root, **dict(zip(names, spawned))}


def anon_rss(proc: psutil.Process) -> float:
    """Anonymous resident memory in MiB: RssAnon on Linux, else RSS minus shared pages."""
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    info = proc.memory_info()
    return (info.rss - getattr(info, "shared", 0)) / MIB


def sample_rss(procs: dict[str, psutil.Process], t: float, done: int) -> Sample:
    rss, anon = {}, {}
    for name, proc in procs.items():
        try:
            rss[name] = proc.memory_info().rss / MIB
            anon[name] = anon_rss(proc)
        except psutil.Error:
            rss[name] = anon[name] = float("nan")
    return Sample(t, rss, anon, done)


def second_half_slope(samples: list[Sample], name: str, per_request: bool, metric: str = "rss") -> float:
    """Least-squares slope of `metric` (rss or anon) over the second half of the samples: MiB per
    minute, or MiB per 1000 completed requests (comparable across runs on a machine whose speed
    varies)."""
    half = samples[len(samples) // 2 :]
    if len(half) < 2:
        return float("nan")
    xs = [s.done / 1000 if per_request else s.t / 60 for s in half]
    ys = [getattr(s, metric)[name] for s in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


# ---------------------------------------------------------------------------------------- workload
PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "List three colors.",
    "Explain gravity to a child in one sentence.",
    "Give me a name for a cat.",
]
FILLER = ["please", "kindly", "quickly", "now", "also", "again", "today", "friend", "thanks", "ok"]


def schema_for(k: int) -> dict[str, Any]:
    """A small JSON schema; k makes its property names (and so its cache key) distinct."""
    return {
        "type": "object",
        "properties": {f"name_{k}": {"type": "string", "maxLength": 12}, f"age_{k}": {"type": "integer"}},
        "required": [f"name_{k}", f"age_{k}"],
    }


class Client:
    def __init__(self, url: str, model: str, max_tokens: int, schema_every: int, stats: LoadStats) -> None:
        self.url = url
        self.model = model
        self.max_tokens = max_tokens
        self.schema_every = schema_every
        self.stats = stats
        self.http = httpx.Client(base_url=url, timeout=300)
        self.counter = itertools.count()

    def one(self, rng: random.Random) -> None:
        n = next(self.counter)
        kind = rng.choice(
            ["chat", "chat_stream", "completion", "completion_echo", "n2", "json", "abort", "disconnect"]
        )
        try:
            getattr(self, f"_{kind}")(rng, n)
            self.stats.add(kind, True)
        except Exception:
            self.stats.add(kind, False)

    def _prompt(self, rng: random.Random) -> str:
        """One of PROMPTS plus 0-40 filler words: prompt lengths (prefill shapes) vary as in
        real traffic."""
        return rng.choice(PROMPTS) + " " + " ".join(rng.choice(FILLER) for _ in range(rng.randint(0, 40)))

    def _messages(self, rng: random.Random) -> list[dict[str, str]]:
        return [{"role": "user", "content": self._prompt(rng)}]

    def _chat(self, rng: random.Random, n: int) -> None:
        body = {"model": self.model, "messages": self._messages(rng), "max_tokens": self.max_tokens}
        self.http.post("/v1/chat/completions", json=body).raise_for_status()

    def _chat_stream(self, rng: random.Random, n: int) -> None:
        body = {
            "model": self.model,
            "messages": self._messages(rng),
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        with self.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            for _ in resp.iter_lines():
                pass

    def _completion(self, rng: random.Random, n: int) -> None:
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": self.max_tokens}
        self.http.post("/v1/completions", json=body).raise_for_status()

    def _completion_echo(self, rng: random.Random, n: int) -> None:
        body = {
            "model": self.model,
            "prompt": self._prompt(rng),
            "max_tokens": 4,
            "echo": True,
            "logprobs": 3,
        }
        self.http.post("/v1/completions", json=body).raise_for_status()

    def _n2(self, rng: random.Random, n: int) -> None:
        body = {
            "model": self.model,
            "prompt": self._prompt(rng),
            "max_tokens": self.max_tokens,
            "n": 2,
            "temperature": 0.8,
        }
        self.http.post("/v1/completions", json=body).raise_for_status()

    def _json(self, rng: random.Random, n: int) -> None:
        k = n // self.schema_every if self.schema_every > 0 else 0
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 48,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema_for(k)}},
        }
        self.http.post("/v1/chat/completions", json=body).raise_for_status()

    def _abort(self, rng: random.Random, n: int) -> None:
        rid = f"soak-abort-{os.getpid()}-{n}"
        body = {
            "rid": rid,
            "text": self._prompt(rng),
            "sampling_params": {"max_new_tokens": 256, "ignore_eos": True},
        }
        done = threading.Thread(target=lambda: self.http.post("/generate", json=body), daemon=True)
        done.start()
        time.sleep(rng.uniform(0.05, 0.5))
        self.http.post("/abort_request", json={"rid": rid}).raise_for_status()
        done.join(timeout=60)

    def _disconnect(self, rng: random.Random, n: int) -> None:
        body = {
            "text": self._prompt(rng),
            "stream": True,
            "sampling_params": {"max_new_tokens": 256, "ignore_eos": True},
        }
        with httpx.Client(base_url=self.url, timeout=60) as one_shot:
            with one_shot.stream("POST", "/generate", json=body) as resp:
                for i, _ in enumerate(resp.iter_lines()):
                    if i >= 3:
                        break  # closing the connection here is the disconnect


def run_load(client: Client, seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        client.one(rng)


# ---------------------------------------------------------------------------------------- server
def start_server(model: str | None, port: int, extra: list[str], log_path: str | None) -> ServerProcess:
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), *extra]
    if model:
        cmd += ["--model-path", model]
    log = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"soak_rss_{port}.log"
    server = ServerProcess("radixserve", cmd, log, f"http://127.0.0.1:{port}")
    server.start()
    return server


def wait_attached(url: str, timeout: float) -> None:
    """A server this script did not start: wait for its /health."""
    deadline = time.monotonic() + timeout
    while http_status(f"{url}/health") != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become healthy")
        time.sleep(1)


def server_pid(url: str, server: ServerProcess | None) -> int:
    if server is not None and server.proc is not None:
        return server.proc.pid
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid
    raise RuntimeError(f"no local process listens on port {port}")


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--url", default=None, help="attach to a running server instead of starting one")
    parser.add_argument("--port", type=int, default=31871)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of load")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--schema-every", type=int, default=1, help="requests per distinct json schema (0: one)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None, help="also write the samples here")
    parser.add_argument("--server-log", default=None, help="write the started server's output here")
    parser.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: extra launch_server flags")
    args = parser.parse_args()
    extra = [a for a in args.server_args if a != "--"]

    server = None
    url = args.url or f"http://127.0.0.1:{args.port}"
    if args.url is None:
        server = start_server(args.model, args.port, extra, args.server_log)
    try:
        if server is not None:
            server.wait_healthy(900)
        else:
            wait_attached(url, 900)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        procs = server_processes(server_pid(url, server))
        stats = LoadStats()
        clients = [
            Client(url, model, args.max_tokens, args.schema_every, stats) for _ in range(args.concurrency)
        ]
        stop = threading.Event()
        threads = [
            threading.Thread(target=run_load, args=(c, args.seed + i, stop), daemon=True)
            for i, c in enumerate(clients)
        ]
        start = time.monotonic()
        samples = [sample_rss(procs, 0.0, 0)]
        for t in threads:
            t.start()
        print(f"{'t (s)':>7} {'requests':>8} " + " ".join(f"{name + ' rss/anon':>22}" for name in procs))
        print_sample(samples[0], procs)
        while time.monotonic() - start < args.duration:
            time.sleep(args.interval)
            samples.append(sample_rss(procs, time.monotonic() - start, stats.total()))
            print_sample(samples[-1], procs)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        time.sleep(2)
        flushed = httpx.post(f"{url}/flush_cache", timeout=60)
        if flushed.status_code == 405:  # servers where flush_cache is still a GET
            flushed = httpx.get(f"{url}/flush_cache", timeout=60)
        time.sleep(2)
        after_flush = sample_rss(procs, time.monotonic() - start, stats.total())
        report(samples, after_flush, stats, flushed.status_code)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(
                    {
                        "samples": [
                            {"t": s.t, "done": s.done, "rss_mib": s.rss, "anon_mib": s.anon} for s in samples
                        ],
                        "after_flush": after_flush.rss,
                        "after_flush_anon": after_flush.anon,
                        "requests": stats.counts,
                        "errors": stats.errors,
                    },
                    f,
                    indent=1,
                )
    finally:
        if server is not None:
            server.stop()


def print_sample(s: Sample, procs: dict[str, psutil.Process]) -> None:
    cells = " ".join(f"{f'{s.rss[n]:.1f}/{s.anon[n]:.1f}':>22}" for n in procs)
    print(f"{s.t:7.0f} {s.done:8d} {cells}", flush=True)


def report(samples: list[Sample], after_flush: Sample, stats: LoadStats, flush_status: int) -> None:
    total = sum(stats.counts.values())
    print(
        f"\nrequests: {total} ok {dict(sorted(stats.counts.items()))}, errors {dict(sorted(stats.errors.items()))}"
    )
    print(f"/flush_cache: HTTP {flush_status}")
    print(
        "| process | memory | start (MiB) | end (MiB) | after flush (MiB) | "
        "growth 2nd half (MiB/min) | growth 2nd half (MiB / 1000 requests) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in samples[0].rss:
        for metric in ("rss", "anon"):
            first, last, flushed = (getattr(s, metric)[name] for s in (samples[0], samples[-1], after_flush))
            print(
                f"| {name} | {metric} | {first:.1f} | {last:.1f} | {flushed:.1f} | "
                f"{second_half_slope(samples, name, False, metric):+.2f} | "
                f"{second_half_slope(samples, name, True, metric):+.1f} |"
            )


if __name__ == "__main__":
    main()
