"""Per-request results and the pure arithmetic that turns them into a serving report.

Nothing here touches the network or the clock, so every number in the report can be checked by
hand in unit tests. Times are seconds inside the dataclasses and milliseconds in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestFuncOutput:
    """What one request produced, as measured by the client."""

    success: bool = False
    latency: float = 0.0  # end-to-end seconds, from send to the last byte
    ttft: float = 0.0  # seconds from send to the first chunk that carries output
    itl: list[float] = field(default_factory=list)  # gaps between output-carrying chunks
    prompt_len: int = 0
    output_len: int = 0  # as counted by the server (meta_info / usage) when it says so
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0  # perf_counter at send, relative to the benchmark start


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    errors: list[str] = field(default_factory=list)  # one per failed request, in request order


def _ms(values: list[float], stat: str) -> float:
    """One statistic of `values` (seconds) in milliseconds: mean, median, std, max, or a
    percentile "pNN" (numpy's default linear interpolation); 0.0 for an empty list.

    An empty list happens legitimately (no streaming -> no ITL; all outputs of length 1 -> no
    TPOT), and a zero keeps the JSONL record numeric instead of NaN.
    """
    if not values:
        return 0.0
    arr = np.asarray(values, dtype=np.float64)
    if stat.startswith("p"):
        return float(np.percentile(arr, float(stat[1:]))) * 1000.0
    return float(getattr(np, stat)(arr)) * 1000.0


def _series_ms(name: str, values: list[float], stats: tuple[str, ...]) -> dict[str, float]:
    """BenchmarkMetrics' fields of one series: {"<stat>_<name>_ms": value} for each stat."""
    return {f"{stat}_{name}_ms": _ms(values, stat) for stat in stats}


def tpot_of(output: RequestFuncOutput) -> float | None:
    """Time per output token after the first; None when there is no second token to time."""
    if output.output_len <= 1:
        return None
    return (output.latency - output.ttft) / (output.output_len - 1)


def calculate_metrics(outputs: list[RequestFuncOutput], duration: float) -> BenchmarkMetrics:
    """Aggregate successful requests; failed ones only count towards `failed` and `errors`."""
    ok = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    ttfts = [o.ttft for o in ok]
    itls = [gap for o in ok for gap in o.itl]
    tpots = [t for t in (tpot_of(o) for o in ok) if t is not None]
    e2es = [o.latency for o in ok]
    # Guard the divisions: a zero-length run (everything failed instantly) still gets a report.
    per_s = 1.0 / duration if duration > 0 else 0.0
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(failed),
        duration_s=duration,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) * per_s,
        input_throughput=total_input * per_s,
        output_throughput=total_output * per_s,
        total_throughput=(total_input + total_output) * per_s,
        # Little's law: average number of requests in flight over the run.
        concurrency=sum(e2es) * per_s,
        **_series_ms("ttft", ttfts, ("mean", "median", "std", "p99")),
        **_series_ms("itl", itls, ("mean", "median", "std", "p95", "p99", "max")),
        **_series_ms("tpot", tpots, ("mean", "median", "std", "p99")),
        **_series_ms("e2e_latency", e2es, ("mean", "median", "std", "p99")),
        errors=[o.error or "unknown error" for o in failed],
    )


_WIDTH = 50


def _section(title: str) -> str:
    return f"{title:-^{_WIDTH}}"


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value:<10}"


def format_report(m: BenchmarkMetrics, header: dict[str, object], max_errors: int = 5) -> str:
    """The human-readable block; `header` holds run settings shown above the numbers."""
    lines = [f"{' Serving Benchmark Result ':=^{_WIDTH}}"]
    lines += [_row(f"{k}:", v) for k, v in header.items()]
    lines += [
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input),
        _row("Total generated tokens:", m.total_output),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Input token throughput (tok/s):", m.input_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_throughput),
        _row("Concurrency:", m.concurrency),
        _section("End-to-End Latency"),
        _row("Mean E2E Latency (ms):", m.mean_e2e_latency_ms),
        _row("Median E2E Latency (ms):", m.median_e2e_latency_ms),
        _row("P99 E2E Latency (ms):", m.p99_e2e_latency_ms),
        _section("Time to First Token"),
        _row("Mean TTFT (ms):", m.mean_ttft_ms),
        _row("Median TTFT (ms):", m.median_ttft_ms),
        _row("P99 TTFT (ms):", m.p99_ttft_ms),
        _section("Time per Output Token (excl. 1st token)"),
        _row("Mean TPOT (ms):", m.mean_tpot_ms),
        _row("Median TPOT (ms):", m.median_tpot_ms),
        _row("P99 TPOT (ms):", m.p99_tpot_ms),
        _section("Inter-Token Latency"),
        _row("Mean ITL (ms):", m.mean_itl_ms),
        _row("Median ITL (ms):", m.median_itl_ms),
        _row("P95 ITL (ms):", m.p95_itl_ms),
        _row("P99 ITL (ms):", m.p99_itl_ms),
        _row("Max ITL (ms):", m.max_itl_ms),
        "=" * _WIDTH,
    ]
    if m.errors:
        lines.append(f"First {min(max_errors, len(m.errors))} of {len(m.errors)} errors:")
        lines += [f"  - {e[:300]}" for e in m.errors[:max_errors]]
    return "\n".join(lines)
