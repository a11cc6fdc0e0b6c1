"""Where a serving step's time goes: a py-spy profile of the scheduler under load, plus every process's CPU.

    python benchmark/profile_serving.py                           # C=64, 128 in / 128 out
    python benchmark/profile_serving.py --concurrency 1 --num-prompts 8
    python benchmark/profile_serving.py --server-flags "--cpu-fp16-weights"

Starts the built-in model's server, drives it with radixserve.bench_serving (streaming, in its own
process), waits for the load to settle, then samples the scheduler process with
`py-spy record --nonblocking` for --duration seconds while reading every process's CPU time from
/proc. It prints two markdown tables (what the scheduler's samples were doing; CPU seconds per
process) that docs/benchmarks.md quotes, and keeps py-spy's raw stacks (--raw-out) for a flamegraph.
Then the full decode batches' step times over the same window (polled from /dashboard/state:
peers/step_times.py), the scheduler's context switches a step (an OpenMP worker that slept
between parallel regions switches voluntarily) and each process's CPU per decoded token. --rate 0
leaves py-spy out (its sampling takes CPU beside the server).

The scheduler's overhead is everything in its samples that is not the model forward or sampling;
IPC is also paid by the tokenizer manager and the detokenizer, whose CPU seconds the second table
shows against the scheduler's. py-spy comes with the `bench` extra (`make setup` installs it).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from peers.process import ServerProcess, free_port
from peers.step_times import StepPoller, summarize

# Categories, first match wins (checked from the top): a frame substring -> category. IPC comes
# first because the send happens inside result processing; the forward before batch construction
# because a forward never runs inside it.
CATEGORIES = (
    ("zmq", "IPC (zmq send/recv, pickling)"),
    ("send_pyobj", "IPC (zmq send/recv, pickling)"),
    ("recv_pyobj", "IPC (zmq send/recv, pickling)"),
    ("ModelRunner.forward", "model forward"),
    ("ModelRunner.sample", "sampling"),
    ("get_next_batch_to_run", "batch construction"),
    ("process_batch_result", "result processing"),
    ("OutputProcessor", "result processing"),
    ("get_model_worker_batch", "batch construction"),
    ("process_input_requests", "request intake"),
)
COMPUTE = ("model forward", "sampling")
CLK_TCK = 100  # /proc/<pid>/stat ticks; Linux's USER_HZ


def classify(stack: str) -> str:
    for needle, category in CATEGORIES:
        if needle in stack:
            return category
    return "other scheduler Python"


def summarize_raw(raw: str) -> Counter[str]:
    """Sample counts per category from py-spy's raw format ('frame;frame;... count' per line)."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[classify(stack)] += int(n)
    return counts


def children(pid: int) -> list[int]:
    """Direct children of pid (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14-15 of stat)


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches summed over a process's threads: an OpenMP worker
    that sleeps between parallel regions (GOMP_SPINCOUNT ran out) switches voluntarily, and pays a
    wake-up at the next region; a thread preempted by another process switches involuntarily."""
    vol = invol = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("voluntary_ctxt_switches:"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                invol += int(line.split()[1])
    return vol, invol


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=192, help="enough to outlast warm-up + duration")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-s", type=float, default=10.0, help="load time before sampling starts")
    p.add_argument("--duration", type=int, default=20, help="seconds py-spy samples")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second (0: no py-spy)")
    p.add_argument("--server-flags", default="", help="extra launch_server flags")
    p.add_argument("--raw-out", default=None, help="keep py-spy's raw stacks here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("py-spy not found: pip install py-spy (the `bench` extra has it)", file=sys.stderr)
        return 2
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += shlex.split(args.server_flags)
    workdir = Path(tempfile.mkdtemp(prefix="radixserve-profile-"))
    raw_path = Path(args.raw_out) if args.raw_out else workdir / "scheduler.raw"
    with ServerProcess("radixserve", cmd, workdir / "server.log", base_url) as server:
        server.wait_healthy(timeout_s=300)
        assert server.proc is not None
        server_pid = server.proc.pid
        client = subprocess.Popen(
            [sys.executable, "-m", "radixserve.bench_serving", "--backend", "radixserve",
             "--base-url", base_url, "--dataset-name", "random-ids",
             "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
             "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
             "--random-range-ratio", "1.0", "--disable-tqdm"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(args.warmup_s)
        procs = {"main (HTTP + tokenizer manager)": server_pid, "bench_serving client": client.pid}
        kids = children(server_pid)
        busiest = max(kids, key=cpu_seconds)  # the scheduler does the math: by far the most CPU
        procs["scheduler"] = busiest
        for i, pid in enumerate(k for k in kids if k != busiest):
            procs[f"other child {i} (detokenizer, resource tracker)"] = pid
        poller = StepPoller(base_url)
        poller.start()
        before = {name: cpu_seconds(pid) for name, pid in procs.items()}
        switches_before = context_switches(busiest)
        tic = time.monotonic()
        if args.rate > 0:
            subprocess.run(
                [py_spy, "record", "--nonblocking", "-p", str(busiest), "-d", str(args.duration),
                 "-r", str(args.rate), "-f", "raw", "-o", str(raw_path)],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        else:  # steps and CPU only: py-spy's own sampling takes CPU from a 2-core box
            time.sleep(args.duration)
            raw_path.write_text("")
        wall = time.monotonic() - tic
        used = {name: cpu_seconds(pid) - before[name] for name, pid in procs.items()}
        switches = tuple(b - a for a, b in zip(switches_before, context_switches(busiest)))
        poller.stop()
        still_loaded = client.poll() is None
        client.terminate()
        client.wait()
    counts = summarize_raw(raw_path.read_text())
    print_report(args, counts, used, wall, still_loaded, raw_path)
    print_steps(args.concurrency, poller, used, switches)
    return 0


def print_steps(
    concurrency: int, poller: StepPoller, used: dict[str, float], switches: tuple[int, ...]
) -> None:
    """The full decode batches' step times, the scheduler's context switches per step (a step
    is `concurrency` decoded tokens) and each process's CPU per decoded token."""
    s = summarize(poller.ordered(), concurrency)
    tokens = poller.decode_tokens[1] - poller.decode_tokens[0]
    print(
        f"\n{s.get('count', 0)} decode steps of {concurrency} requests, {tokens} decoded tokens in the window"
    )
    if s["count"]:
        print(f"step (launch to result) median {s['median_ms']:.1f} ms, p90 {s['p90_ms']:.1f}, "
              f"max {s['max_ms']:.1f}; launch-to-launch median {s['median_period_ms']:.1f} ms")  # fmt: skip
    if tokens:
        steps = tokens / concurrency
        print(f"scheduler context switches per {concurrency}-token step: {switches[0] / steps:.0f} voluntary, "
              f"{switches[1] / steps:.0f} involuntary")  # fmt: skip
        print("\n| process | CPU ms per decoded token |\n|---|---:|")
        for name, seconds in sorted(used.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {1e3 * seconds / tokens:.3f} |")


def print_report(
    args: argparse.Namespace,
    counts: Counter[str],
    used: dict[str, float],
    wall: float,
    loaded: bool,
    raw: Path,
) -> None:
    total = sum(counts.values()) or 1
    print(f"\nScheduler samples, concurrency {args.concurrency}, {args.input_len} in / {args.output_len} out, "
          f"{args.duration} s at {args.rate} Hz ({total} samples; raw stacks: {raw})")  # fmt: skip
    if not loaded:
        print("WARNING: the client finished before sampling ended; raise --num-prompts")
    print("\n| scheduler samples in | share |\n|---|---:|")
    for category, n in counts.most_common():
        print(f"| {category} | {100 * n / total:.1f}% |")
    overhead = sum(n for c, n in counts.items() if c not in COMPUTE)
    print(f"| **everything but forward + sampling** | **{100 * overhead / total:.1f}%** |")
    print(f"\n| process | CPU s over {wall:.1f} s wall |\n|---|---:|")
    for name, seconds in sorted(used.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
