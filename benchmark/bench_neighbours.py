"""Throughput beside busy neighbour processes: radixserve and llama-server serving the same file.

    python benchmark/bench_neighbours.py                       # 0/1/2 neighbours, C=1 and C=16
    python benchmark/bench_neighbours.py --engines radixserve --neighbours 0 1 --concurrency 1
    python benchmark/bench_neighbours.py --baseline-tree /tmp/base   # radixserve of another checkout too

A neighbour is a process that spins on one core (`while True: pass`), the way a build, a test run
or another tenant's job sits beside a server on a container host or a laptop. Each engine is
started once and warmed up at each concurrency; for each neighbour count the neighbours are started, each concurrency is measured
with radixserve's client (radixserve.bench_serving: random-ids prompts, greedy, EOS ignored), and
the neighbours are stopped. The table gives output tokens/s and each count's ratio to the idle
run of the same engine and concurrency (the goal: >= 40% with one neighbour on a 2-core machine,
and no worse a ratio than llama-server's).

Both engines serve the built-in model's own Q4_1 GGUF: radixserve by default (its GGUF tensors
through sgl-kernel's linear_wq), llama-server with `-m` on that file and `-t` = the CPUs this
process may use. --baseline-tree DIR adds "radixserve@DIR": the same command with DIR/python first
on PYTHONPATH, so two versions are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The servers get the caller's environment as it was before radixserve's import set its defaults
# (OMP_WAIT_POLICY), so a --baseline-tree server runs exactly as that version would on its own.
CALLER_ENV = dict(os.environ)

from peers import llama_cpp  # noqa: E402
from peers.process import ServerProcess, free_port  # noqa: E402

from radixserve.utils.cpus import available_cpus  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SPIN = "while True: pass"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="*", default=["radixserve", "llama-server"])
    p.add_argument("--neighbours", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prompts-per-concurrency", type=float, default=3.0)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument(
        "--threads", type=int, default=available_cpus(), help="llama-server -t (radixserve: its default)"
    )
    p.add_argument("--baseline-tree", type=Path, default=None)
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench_neighbours"))
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


@contextlib.contextmanager
def neighbours(count: int) -> Iterator[None]:
    """`count` processes that each keep one core busy until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0.0)  # let the kernel spread them
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def engine_command(
    engine: str, port: int, args: argparse.Namespace, model_gguf: Path
) -> tuple[list[str], str]:
    """The server command of `engine` and its bench_serving backend."""
    if engine.startswith("radixserve"):
        cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port)]
        return cmd, "radixserve"
    if engine == "llama-server":
        binary = llama_cpp.build_server()
        slots = max(args.concurrency)
        return llama_cpp.server_command(
            binary, model_gguf, port, threads=args.threads, parallel=slots
        ), "openai"
    raise SystemExit(f"unknown engine {engine!r}")


def engine_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    env = {**CALLER_ENV, "HF_HUB_OFFLINE": "1"}
    if engine.startswith("radixserve@"):
        tree = str(args.baseline_tree.resolve() / "python")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    return env


def measure(
    backend: str, base_url: str, tokenizer: Path, concurrency: int, args: argparse.Namespace
) -> float:
    """Output tokens/s of one bench_serving run at `concurrency`."""
    from radixserve import bench_serving

    prompts = max(args.min_prompts, round(args.prompts_per_concurrency * concurrency))
    argv = [
        *("--backend", backend, "--base-url", base_url, "--tokenizer", str(tokenizer)),
        *("--num-prompts", str(prompts), "--max-concurrency", str(concurrency)),
        *("--seed", str(args.seed + concurrency), "--warmup-requests", "1", "--disable-tqdm"),
        *("--dataset-name", "random-ids", "--random-range-ratio", "1.0"),
        *("--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)),
    ]
    metrics = vars(bench_serving.main(argv))
    if metrics["failed"]:
        raise RuntimeError(f"{metrics['failed']} requests failed: {metrics['errors'][:3]}")
    return float(metrics["output_throughput"])


def run_engine(
    engine: str, args: argparse.Namespace, tokenizer: Path, model_gguf: Path
) -> list[dict[str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, backend = engine_command(engine, port, args, model_gguf)
    log = args.log_dir / f"{engine.replace('/', '_')}.log"
    rows = []
    with ServerProcess(engine, cmd, log, url, engine_env(engine, args)) as server:
        server.wait_healthy(args.server_timeout)
        for c in args.concurrency:  # first batches of a size pay one-time costs (oneDNN primitives)
            measure(backend, url, tokenizer, c, args)
        for count in args.neighbours:
            with neighbours(count):
                for c in args.concurrency:
                    tps = measure(backend, url, tokenizer, c, args)
                    print(f"[{engine}] neighbours={count} C={c}: {tps:.1f} tok/s", flush=True)
                    rows.append({"engine": engine, "neighbours": count, "concurrency": c, "tok_s": tps})
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    counts = args.neighbours
    head = "| engine | C | " + " | ".join(f"{n} busy" for n in counts) + " |"
    lines = [head, "|" + "---|" * (2 + len(counts))]
    for engine in dict.fromkeys(r["engine"] for r in rows):
        for c in args.concurrency:
            by_n = {
                r["neighbours"]: r["tok_s"] for r in rows if r["engine"] == engine and r["concurrency"] == c
            }
            idle = by_n.get(0)
            cells = []
            for n in counts:
                tps = by_n.get(n)
                ratio = f" ({tps / idle:.0%})" if tps is not None and idle and n else ""
                cells.append("-" if tps is None else f"{tps:.1f}{ratio}")
            lines.append(f"| {engine} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "?").strip()
    return (
        f"{name} (family {fields.get('CPU family', '?').strip()}, model {fields.get('Model', '?').strip()})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from radixserve.model_loader.default_model import ensure_default_model, find_default_gguf

    tokenizer = Path(ensure_default_model())
    model_gguf = Path(find_default_gguf())
    engines = list(args.engines)
    if args.baseline_tree is not None:
        engines.append(f"radixserve@{args.baseline_tree}")
    rows: list[dict[str, Any]] = []
    for engine in engines:
        rows += run_engine(engine, args, tokenizer, model_gguf)
    print(f"\nCPU: {cpu_name()}, {available_cpus()} CPUs available; output tokens/s (ratio to idle)")
    print(f"random-ids {args.input_len} -> {args.output_len}, command: {' '.join(sys.argv)}")
    print(report(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
