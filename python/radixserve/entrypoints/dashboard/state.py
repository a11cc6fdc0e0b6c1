"""/dashboard/state: one JSON document with everything the page draws (docs/observability.md).

Each call asks every replica's scheduler once (GetDashboardStateReq, through the control client
as /get_load does), reads the HTTP process's latency histograms when --enable-metrics is on, and
turns growing counters into rates over the last seconds (window.py).
"""

from __future__ import annotations

import time
from typing import Any

from radixserve.entrypoints.dashboard.window import (
    LATENCY_WINDOW_S,
    RATE_WINDOW_S,
    Counts,
    MetricsWindow,
    Snapshot,
)
from radixserve.managers.io_struct import GetDashboardStateReq
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.utils.metrics import ITL_BUCKETS, LATENCY_BUCKETS, ServerMetrics

DEFAULT_ROWS = 50
MAX_ROWS = 200
# Scheduler counters turned into rates / ratios.
COUNTERS = (
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_batches",
    "cache_hit_tokens",
    "cache_query_tokens",
)
HISTOGRAMS = (("ttft", LATENCY_BUCKETS), ("itl", ITL_BUCKETS))


def _snapshot(reports: list[dict[str, Any]], metrics: ServerMetrics | None, now: float) -> Snapshot:
    counters = {f"{r['dp_rank']}/{name}": float(r[name]) for r in reports for name in COUNTERS}
    histograms: dict[str, Counts] = {}
    if metrics is not None:
        for name, per_replica in (("ttft", metrics.ttft), ("itl", metrics.itl)):
            for d, hist in enumerate(per_replica.children):
                histograms[f"{d}/{name}"] = Counts(tuple(hist.counts), hist.num)
    return Snapshot(now, counters, histograms)


def _replica_view(
    report: dict[str, Any], snap: Snapshot, window: MetricsWindow, with_latency: bool
) -> dict[str, Any]:
    d = report["dp_rank"]
    total = max(report["max_total_num_tokens"], 1)
    view = {
        **report,
        "kv_usage": report["used_tokens"] / total,
        "cache_usage": report["cached_tokens"] / total,
        "prefill_tokens_per_s": window.rate(snap, f"{d}/num_prefill_tokens"),
        "decode_tokens_per_s": window.rate(snap, f"{d}/num_decode_tokens"),
        "batches_per_s": window.rate(snap, f"{d}/num_batches"),
        "cache_hit_rate": _hit_rate(snap, window, d),
        "cache_hit_rate_total": report["cache_hit_tokens"] / max(report["cache_query_tokens"], 1),
    }
    for name, bounds in HISTOGRAMS:
        view[name] = window.percentiles(snap, f"{d}/{name}", bounds) if with_latency else None
    return view


def _hit_rate(snap: Snapshot, window: MetricsWindow, d: int) -> float | None:
    """Over the rate window, or the latency window when no prompt was looked up in the former
    (prefills are rare when requests are long): the chart keeps a line instead of dots."""
    hits, queries = f"{d}/cache_hit_tokens", f"{d}/cache_query_tokens"
    rate = window.ratio(snap, hits, queries)
    return rate if rate is not None else window.ratio(snap, hits, queries, LATENCY_WINDOW_S)


async def dashboard_state(tm: TokenizerManager, window: MetricsWindow, max_rows: int) -> dict[str, Any]:
    replies = await tm.control.ask_all(GetDashboardStateReq(max_rows=min(max(max_rows, 0), MAX_ROWS)))
    reports = sorted((r.state for r in replies), key=lambda r: r["dp_rank"])
    snap = _snapshot(reports, tm.metrics, time.monotonic())
    window.observe(snap)
    args = tm.server_args
    return {
        "time": time.time(),
        "model": tm.served_model_name,
        "dp_size": args.dp_size,
        "tp_size": args.tp_size,
        "pp_size": args.pp_size,
        "metrics_enabled": tm.metrics is not None,
        "rate_window_s": RATE_WINDOW_S,
        "latency_window_s": LATENCY_WINDOW_S,
        "num_in_flight": tm.num_in_flight,
        "replicas": [_replica_view(r, snap, window, tm.metrics is not None) for r in reports],
    }
