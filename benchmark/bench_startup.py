"""Start-up time of the server and of the Engine: median of N fresh starts.

Server: `python -m radixserve.launch_server` from process launch to the readiness line (READY_LINE,
logged after the warm-up request) and to "Child processes ready" (the scheduler(s) and detokenizer
reported ready), plus the CPU seconds each process of the tree had spent by the readiness line.
Engine: a fresh interpreter that runs `radixserve.Engine(...)`, from process launch to the
constructor's return, and the CPU seconds of that process and its children at that moment.

    python benchmark/bench_startup.py                            # the built-in model, 5 starts each
    python benchmark/bench_startup.py --tiny --runs 7            # a tiny random llama instead
    python benchmark/bench_startup.py --what server -- --max-total-tokens 8192   # extra server flags
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil

READY_LINE = "The server is fired up and ready to roll!"  # radixserve.launch_server.READY_LINE
CHILDREN_READY = "Child processes ready"
TIMEOUT_S = 600.0

HERE = os.path.dirname(os.path.abspath(__file__))
# The Engine run: a fresh interpreter (so its imports count), timed from its launch by the parent.
ENGINE_SCRIPT = (
    f"import sys; sys.path.insert(0, {HERE!r}); import bench_startup; bench_startup.engine_child()"
)


def _spawned(proc: psutil.Process) -> list[psutil.Process]:
    """The children multiprocessing spawned, in start order (the resource tracker is not one)."""
    kids = []
    for child in proc.children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                kids.append(child)
        except psutil.Error:
            continue
    return sorted(kids, key=lambda c: c.create_time())


def _cpu_seconds(proc: psutil.Process) -> dict[str, float]:
    """User + system CPU seconds of `proc` ("main") and of each spawned child, by start order
    (a single-rank server: child0 = scheduler, child1 = detokenizer)."""
    cpu = {"main": sum(proc.cpu_times()[:2])}
    for i, child in enumerate(_spawned(proc)):
        cpu[f"child{i}"] = sum(child.cpu_times()[:2])
    return cpu


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_until(proc: subprocess.Popen, marks: list[str], started: float) -> dict[str, float]:
    """Seconds from `started` to the first output line containing each mark, in order; the
    output is drained afterwards so the process never blocks on a full pipe."""
    seen: dict[str, float] = {}
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        for mark in marks:
            if mark not in seen and mark in line:
                seen[mark] = time.monotonic() - started
        if len(seen) == len(marks):
            break
    else:
        raise RuntimeError(f"exited (code {proc.wait()}) before {marks}:\n{''.join(tail)}")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return seen


def start_server_once(model_path: str, flags: list[str]) -> dict[str, Any]:
    from radixserve.utils.network import get_free_port

    cmd = [sys.executable, "-m", "radixserve.launch_server", "--model-path", model_path]
    cmd += ["--port", str(get_free_port()), "--log-level", "info", *flags]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = _read_until(proc, [CHILDREN_READY, READY_LINE], started)
        cpu = _cpu_seconds(psutil.Process(proc.pid))
    finally:
        _stop(proc)
    return {"children_ready_s": seen[CHILDREN_READY], "ready_s": seen[READY_LINE], "cpu_s": cpu}


def engine_child() -> None:
    """In the fresh interpreter: build the Engine, print its children's CPU seconds, shut down."""
    from radixserve import Engine

    engine = Engine(model_path=sys.argv[1], **json.loads(sys.argv[2]))
    print("ENGINE_READY " + json.dumps(_cpu_seconds(psutil.Process())), flush=True)
    engine.shutdown()


def start_engine_once(model_path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-c", ENGINE_SCRIPT, model_path, json.dumps(kwargs)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            if line.startswith("ENGINE_READY "):
                ready_s = time.monotonic() - started
                cpu = json.loads(line.split(" ", 1)[1])
                break
        else:
            raise RuntimeError(f"engine exited (code {proc.wait()}):\n{''.join(tail)}")
        proc.wait(timeout=60)
    finally:
        _stop(proc)
    return {"ready_s": ready_s, "cpu_s": cpu}


def summarize(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs of every time and of each process's CPU seconds."""
    out: dict[str, Any] = {"what": name, "runs": len(runs)}
    for key in ("children_ready_s", "ready_s"):
        if key in runs[0]:
            out[key] = round(statistics.median(r[key] for r in runs), 2)
            out[key + "_all"] = [round(r[key], 2) for r in runs]
    procs = sorted({p for r in runs for p in r["cpu_s"]})
    out["cpu_s"] = {p: round(statistics.median(r["cpu_s"].get(p, 0.0) for r in runs), 2) for p in procs}
    out["cpu_s_total"] = round(statistics.median(sum(r["cpu_s"].values()) for r in runs), 2)
    return out


def _model_path(args: argparse.Namespace, tmp: str) -> str:
    if args.model_path:
        return args.model_path
    if args.tiny:
        from radixserve.testing.tiny_models import make_tiny_model

        return str(make_tiny_model("llama", os.path.join(tmp, "tiny_llama")))
    from radixserve.model_loader.default_model import ensure_default_model

    return str(ensure_default_model(show_progress=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama (made in a temp dir)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--what", choices=["server", "engine", "both"], default="both")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON lines")
    parser.add_argument("flags", nargs="*", help="extra server flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = _model_path(args, tmp)
        engine_kwargs = _flags_to_kwargs(args.flags)
        summaries = []
        if args.what in ("server", "both"):
            runs = [start_server_once(model, args.flags) for _ in range(args.runs)]
            summaries.append(summarize("server", runs))
        if args.what in ("engine", "both"):
            runs = [start_engine_once(model, engine_kwargs) for _ in range(args.runs)]
            summaries.append(summarize("engine", runs))
    cpu_name = _cpu_name()
    for s in summaries:
        if args.json:
            print(json.dumps({**s, "cpu": cpu_name}))
        else:
            print(_format(s))
    print(f"cpu: {cpu_name}, {os.cpu_count()} logical CPUs")


def _flags_to_kwargs(flags: list[str]) -> dict[str, Any]:
    """`--max-total-tokens 8192 --disable-overlap` -> Engine kwargs (values as JSON when they parse)."""
    kwargs: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        key = flags[i].lstrip("-").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value: Any = flags[i + 1]
            try:
                value = json.loads(value)
            except ValueError:
                pass
            kwargs[key], i = value, i + 2
        else:
            kwargs[key], i = True, i + 1
    return kwargs


def _format(s: dict[str, Any]) -> str:
    lines = [f"{s['what']}: median of {s['runs']} starts"]
    for key, label in (("children_ready_s", "children ready"), ("ready_s", "ready")):
        if key in s:
            lines.append(f"  {label:15s} {s[key]:7.2f} s   (all: {s[key + '_all']})")
    cpu = ", ".join(f"{p} {v:.2f}" for p, v in s["cpu_s"].items())
    lines.append(f"  CPU seconds     {s['cpu_s_total']:7.2f} s   ({cpu})")
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
