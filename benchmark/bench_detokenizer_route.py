"""The serving processes' CPU and wake-ups per token, `--detokenizer process` against `inline`.

    python benchmark/bench_detokenizer_route.py                         # C=1, 4 x 128/128, 3 rounds
    python benchmark/bench_detokenizer_route.py --concurrency 16 --num-prompts 32 --output-len 64

Starts the built-in model's server twice (one per route, both alive for the whole run), then in
each round drives each with `radixserve.bench_serving` (streaming /generate, random ids, greedy)
in turn while reading every server process's `/proc/<pid>/task/*` CPU time and context switches
before and after. It prints one markdown row per route and round: CPU ms and voluntary context
switches per generated token of the tokenizer manager (the main process), the detokenizer and
the scheduler, and bench_serving's median TPOT. On a 2-core machine whatever the tokenizer manager
and the detokenizer take per token is taken from the forward's two threads (docs/cpu_backend.md,
"One stream served"); the CPU and the switches are the steadier numbers on a shared box.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from peers.process import ServerProcess, free_port
from profile_serving import CLK_TCK, children  # /proc helpers shared with the serving profile

ROUTES = ("process", "inline")


def usage(pid: int) -> tuple[int, int]:
    """(CPU ticks, voluntary context switches) summed over a process's threads."""
    ticks = switches = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = (task / "status").read_text().splitlines()
        except OSError:
            continue  # a thread that ended meanwhile
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
        switches += sum(int(s.split()[1]) for s in status if s.startswith("voluntary_ctxt_switches:"))
    return ticks, switches


def server_processes(root: int) -> dict[str, int]:
    """The tokenizer manager (the launched process), the detokenizer and the scheduler by name:
    the children's command lines are alike (multiprocessing spawn), so the scheduler is the one
    with the most threads (its compute pool) and the detokenizer the other generic child."""
    kids = [c for c in children(root) if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
    by_threads = sorted(kids, key=lambda c: len(list(Path(f"/proc/{c}/task").glob("*"))))
    assert len(by_threads) == 2, f"expected a scheduler and a detokenizer, got children {kids}"
    return {"tokenizer manager": root, "detokenizer": by_threads[0], "scheduler": by_threads[1]}


def drive(url: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "radixserve.bench_serving", "--backend", "radixserve", "--base-url", url]
    cmd += [
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        str(args.num_prompts),
        "--random-range-ratio",
        "1",
    ]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--max-concurrency", str(args.concurrency), "--disable-tqdm", "--output-file", str(out)]
    out.unlink(missing_ok=True)  # bench_serving appends one JSON line a run
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads(out.read_text().splitlines()[-1])


def measure(url: str, procs: dict[str, int], args: argparse.Namespace, out: Path) -> dict[str, float]:
    before = {name: usage(pid) for name, pid in procs.items()}
    result = drive(url, args, out)
    after = {name: usage(pid) for name, pid in procs.items()}
    tokens = int(result["total_output"])
    row: dict[str, float] = {"tokens": tokens, "tpot": float(result["median_tpot_ms"])}
    for name in procs:
        row[f"{name} cpu"] = (after[name][0] - before[name][0]) * 1000 / CLK_TCK / tokens
        row[f"{name} sw"] = (after[name][1] - before[name][1]) / tokens
    return row


def print_row(route: str, rnd: int, row: dict[str, float]) -> None:
    names = ("tokenizer manager", "detokenizer", "scheduler")
    cells = [f"{row[f'{n} cpu']:.3f} / {row[f'{n} sw']:.2f}" for n in names]
    both = row["tokenizer manager cpu"] + row["detokenizer cpu"]
    print(f"| {route} | {rnd} | {' | '.join(cells)} | {both:.3f} | {row['tpot']:.1f} |", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="each round drives every route once, in turn")
    p.add_argument("--server-flags", nargs=argparse.REMAINDER, default=[], help="extra launch_server flags")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="radixserve-detok-route-"))
    servers: dict[str, ServerProcess] = {}
    try:
        for route in ROUTES:
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "radixserve.launch_server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            cmd += ["--detokenizer", route, *args.server_flags]
            servers[route] = ServerProcess(route, cmd, workdir / f"{route}.log", f"http://127.0.0.1:{port}")
            servers[route].start()
        for server in servers.values():
            server.wait_healthy(timeout_s=600)
        procs = {r: server_processes(s.proc.pid) for r, s in servers.items() if s.proc is not None}
        print(
            "| route | round | tokenizer manager: CPU ms / switches a token | detokenizer | scheduler "
            "| TM + detokenizer CPU ms | median TPOT ms |"
        )
        print("|---|---:|---|---|---|---:|---:|")
        for rnd in range(1, args.rounds + 1):
            for route, server in servers.items():
                print_row(route, rnd, measure(server.base_url, procs[route], args, workdir / "bench.json"))
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
