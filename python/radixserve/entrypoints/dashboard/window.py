"""Rates and latency percentiles over the last seconds, from snapshots of growing counters.

The schedulers report counters that only grow (batch tokens, cache hits) and the HTTP process's
metrics keep cumulative histograms (TTFT, ITL). A rate or a percentile "now" is the difference
between the current snapshot and one taken `window_s` earlier. Snapshots are taken only when
/dashboard/state is asked for, at most one per MIN_INTERVAL_S, and the ring is bounded, so the
cost is nothing while no page is open and constant while one is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_INTERVAL_S = 0.5  # snapshots closer than this are not kept
KEEP_S = 60.0  # the longest window asked for
RATE_WINDOW_S = 5.0  # tokens/s and cache hit rate: short, so the charts react
LATENCY_WINDOW_S = 30.0  # percentiles: long enough to hold a few requests
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Counts:
    """A histogram's state: per-bucket counts (not cumulative; bucket i holds values in
    (bounds[i-1], bounds[i]]) and the number of all values, those above the last bound included."""

    buckets: tuple[int, ...]
    num: int


@dataclass(frozen=True)
class Snapshot:
    time: float
    counters: dict[str, float] = field(default_factory=dict)  # "dp_rank/name" -> value
    histograms: dict[str, Counts] = field(default_factory=dict)  # "dp_rank/name" -> counts


def quantile(bounds: Sequence[float], counts: Sequence[int], num: int, q: float) -> float | None:
    """The q-quantile of values counted in buckets with upper `bounds` (Prometheus'
    histogram_quantile: linear within the bucket; past the last bound, the last bound)."""
    if num <= 0:
        return None
    target = q * num
    cumulative, lower = 0, 0.0
    for bound, count in zip(bounds, counts):
        if count and cumulative + count >= target:
            return lower + (bound - lower) * (target - cumulative) / count
        cumulative += count
        lower = bound
    return float(bounds[-1])


class MetricsWindow:
    def __init__(self, keep_s: float = KEEP_S, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.keep_s = keep_s
        self.min_interval_s = min_interval_s
        self.snapshots: deque[Snapshot] = deque(maxlen=int(keep_s / min_interval_s) + 2)

    def observe(self, snap: Snapshot) -> None:
        """Keep `snap` unless one was kept less than min_interval_s before it."""
        if self.snapshots and snap.time - self.snapshots[-1].time < self.min_interval_s:
            return
        self.snapshots.append(snap)
        while self.snapshots and snap.time - self.snapshots[0].time > self.keep_s:
            self.snapshots.popleft()

    def baseline(self, now: Snapshot, window_s: float) -> Snapshot | None:
        """The oldest kept snapshot within `window_s` before `now` (not `now` itself)."""
        for snap in self.snapshots:
            if now.time - snap.time <= window_s and snap.time < now.time:
                return snap
        return None

    def delta(self, now: Snapshot, then: Snapshot | None, key: str) -> float:
        """How much counter `key` grew; a counter that went down was reset (a cache flush)."""
        current = now.counters.get(key, 0.0)
        before = then.counters.get(key, 0.0) if then is not None else 0.0
        return current - before if current >= before else current

    def rate(self, now: Snapshot, key: str, window_s: float = RATE_WINDOW_S) -> float | None:
        then = self.baseline(now, window_s)
        if then is None:
            return None
        return self.delta(now, then, key) / (now.time - then.time)

    def ratio(
        self, now: Snapshot, num_key: str, den_key: str, window_s: float = RATE_WINDOW_S
    ) -> float | None:
        then = self.baseline(now, window_s)
        if then is None:
            return None
        den = self.delta(now, then, den_key)
        return self.delta(now, then, num_key) / den if den > 0 else None

    def percentiles(
        self, now: Snapshot, key: str, bounds: Sequence[float], window_s: float = LATENCY_WINDOW_S
    ) -> dict[str, float | int | None]:
        """{"p50", "p90", "p99", "count"} of the values observed in the window (the whole history
        until the window is filled)."""
        current = now.histograms.get(key)
        if current is None:
            return {"count": 0, **{_name(q): None for q in QUANTILES}}
        then = self.baseline(now, window_s)
        before = then.histograms.get(key) if then is not None else None
        if before is None or before.num > current.num:  # no baseline yet, or a reset
            before = Counts(tuple(0 for _ in current.buckets), 0)
        counts = [c - b for c, b in zip(current.buckets, before.buckets)]
        num = current.num - before.num
        return {"count": num, **{_name(q): quantile(bounds, counts, num, q) for q in QUANTILES}}


def _name(q: float) -> str:
    return f"p{round(q * 100):d}"
