"""A served scheduler's per-step times, read from /dashboard/state while a benchmark runs.

The scheduler keeps its last 32 batches (scheduler/batch_log.py: launch time, forward mode,
requests, milliseconds from launch to the result being processed). Polling faster than 32 steps
fill the ring keeps every step; `StepPoller` merges the polls by launch time. The summary puts
the served decode step (launch to result: forward, sampling, output processing) beside the
launch-to-launch period (that plus the scheduler's loop between steps), which is what a
request's TPOT sees in a full decode batch.
"""

from __future__ import annotations

import json
import statistics
import threading
import urllib.request
from typing import Any

POLL_S = (
    0.3  # 32 batches at the fastest served step measured (~5 ms at C=1) is 160 ms; C>=16 steps are >20 ms
)


def fetch_batches(base_url: str, timeout_s: float = 15.0) -> tuple[list[dict[str, Any]], int]:
    """The recent batches (oldest first) and the decode-token counter of /dashboard/state's first
    replica (one data-parallel replica: the benchmarks' servers)."""
    with urllib.request.urlopen(f"{base_url}/dashboard/state?max_rows=0", timeout=timeout_s) as resp:
        state = json.loads(resp.read())["replicas"][0]
    batches = list(reversed(state.get("batches", [])))
    return batches, int(state.get("num_decode_tokens", 0))


class StepPoller:
    """Polls /dashboard/state on a thread between start() and stop(); `steps` holds each batch once."""

    def __init__(self, base_url: str, poll_s: float = POLL_S) -> None:
        self.base_url = base_url
        self.poll_s = poll_s
        self.steps: dict[float, dict[str, Any]] = {}
        self.decode_tokens = (0, 0)  # the counter at start() and at stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.decode_tokens = (fetch_batches(self.base_url)[1], 0)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.decode_tokens = (self.decode_tokens[0], fetch_batches(self.base_url)[1])

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                batches, _ = fetch_batches(self.base_url)
            except OSError:
                continue  # a slow answer under load: the next poll still sees the ring
            for b in batches:
                self.steps[b["launched_at"]] = b

    def ordered(self) -> list[dict[str, Any]]:
        return [self.steps[t] for t in sorted(self.steps)]


def summarize(steps: list[dict[str, Any]], batch_size: int) -> dict[str, float]:
    """Decode steps of exactly `batch_size` requests: count, median and p90 ms (launch to result),
    and the median launch-to-launch period from one such step to the next (consecutive only)."""
    full = [s for s in steps if s["mode"] == "decode" and s["num_reqs"] == batch_size]
    if not full:
        return {"count": 0}
    ms = sorted(s["ms"] for s in full)
    is_full = {id(s) for s in full}
    periods = [
        (b["launched_at"] - a["launched_at"]) * 1e3
        for a, b in zip(steps, steps[1:])
        if id(a) in is_full and id(b) in is_full
    ]
    return {
        "count": len(full),
        "median_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "max_ms": ms[-1],
        "median_period_ms": statistics.median(periods) if periods else float("nan"),
    }
