"""Prometheus metrics in the text exposition format, with no client library.

The TokenizerManager owns one `ServerMetrics` and updates it from its event loop only, so the
counters need no locks; /metrics renders a snapshot.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# SGLang's names and labels (`sglang:<name>{model_name="..."}`), so its Grafana dashboards, the
# Gateway and autoscalers that scrape SGLang read these unchanged.
PREFIX = "sglang"

# Bucket upper bounds in seconds: fine below 1 s where interactive latencies live.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        idx = bisect.bisect_left(self.buckets, value)
        if idx < len(self.counts):
            self.counts[idx] += 1
        self.total += value
        self.num += 1

    def render(self) -> list[str]:
        name = f"{PREFIX}:{self.name}"
        return [f"# HELP {name} {self.help}", f"# TYPE {name} histogram", *self.series()]

    def series(self, label: str = "") -> list[str]:
        """The sample lines; `label` (e.g. 'dp_rank="1"') goes into every one of them."""
        name = f"{PREFIX}:{self.name}"
        sep = "," if label else ""
        lines = []
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            lines.append(f'{name}_bucket{{{label}{sep}le="{_fmt(bound)}"}} {cumulative}')
        lines.append(f'{name}_bucket{{{label}{sep}le="+Inf"}} {self.num}')
        braces = f"{{{label}}}" if label else ""
        lines.append(f"{name}_sum{braces} {_fmt(self.total)}")
        lines.append(f"{name}_count{braces} {self.num}")
        return lines


@dataclass
class PerReplicaHistogram:
    """A histogram with one series per data-parallel replica (label `dp_rank`) when dp_size > 1."""

    name: str
    help: str
    buckets: tuple[float, ...]
    dp_size: int
    children: list[Histogram] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.children = [Histogram(self.name, self.help, self.buckets) for _ in range(self.dp_size)]

    @property
    def num(self) -> int:
        return sum(h.num for h in self.children)

    def observe(self, value: float, dp_rank: int | None = None) -> None:
        self.children[_replica(dp_rank, self.dp_size)].observe(value)

    def render(self) -> list[str]:
        if self.dp_size == 1:
            return self.children[0].render()
        name = f"{PREFIX}:{self.name}"
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        for d, child in enumerate(self.children):
            lines += child.series(f'dp_rank="{d}"')
        return lines


@dataclass
class Scalar:
    name: str
    help: str
    kind: str  # "counter" or "gauge"
    value: float = 0.0

    def render(self) -> list[str]:
        name = f"{PREFIX}:{self.name}"
        return [f"# HELP {name} {self.help}", f"# TYPE {name} {self.kind}", f"{name} {_fmt(self.value)}"]


@dataclass
class PerReplicaCounter:
    """A counter (or gauge) with one series per data-parallel replica (label `dp_rank`) when
    dp_size > 1, as SGLang labels its scheduler metrics with --dp-size > 1."""

    name: str
    help: str
    dp_size: int
    kind: str = "counter"
    values: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.values = [0.0] * self.dp_size

    @property
    def value(self) -> float:
        return sum(self.values)

    def add(self, amount: float, dp_rank: int | None) -> None:
        self.values[_replica(dp_rank, self.dp_size)] += amount

    def render(self) -> list[str]:
        name = f"{PREFIX}:{self.name}"
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} {self.kind}"]
        if self.dp_size == 1:
            return [*lines, f"{name} {_fmt(self.values[0])}"]
        return lines + [f'{name}{{dp_rank="{d}"}} {_fmt(v)}' for d, v in enumerate(self.values)]


def _replica(dp_rank: int | None, dp_size: int) -> int:
    """The series a dp_rank counts in (replica 0 when the rank is unknown or out of range)."""
    return dp_rank if dp_rank is not None and 0 <= dp_rank < dp_size else 0


def with_model_name(lines: list[str], model_name: str | None) -> list[str]:
    """SGLang's `model_name` label added to every sample line (None: unchanged)."""
    if model_name is None:
        return lines
    label = f'model_name="{_escape(model_name)}"'
    return [_with_label(line, label) for line in lines]


def _escape(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _with_label(line: str, label: str) -> str:
    """`label` added first to a sample line's labels (comment lines unchanged)."""
    if line.startswith("#"):
        return line
    name, _, rest = line.partition(" ")
    if name.endswith("}"):
        head, _, labels = name.partition("{")
        return f"{head}{{{label},{labels} {rest}"
    return f"{name}{{{label}}} {rest}"


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf"
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


class ServerMetrics:
    """Request-level metrics as seen by the TokenizerManager."""

    def __init__(
        self,
        max_total_num_tokens: int,
        dp_size: int = 1,
        speculative: bool = False,
        model_name: str | None = None,
    ) -> None:
        """`max_total_num_tokens`: the KV tokens of every replica together. With `dp_size` > 1 the
        counters and histograms carry a `dp_rank` label (the replica that served the request) and
        the load gauges come per replica from the replicas' load reports (`set_replica_loads`).
        `speculative`: render the speculative-decoding series. `model_name`: every series carries
        it as SGLang's `model_name` label (the served model name)."""
        self.model_name = model_name
        self.max_total_num_tokens = max(1, max_total_num_tokens)
        self.dp_size = dp_size
        self.speculative = speculative  # render the speculative-decoding series
        self.spec_verify_ct = Scalar(
            "spec_verify_ct_total", "Verify forwards of finished requests (speculative decoding).", "counter"
        )
        self.spec_verify_tokens = Scalar(
            "spec_verify_tokens_total", "Tokens those verify forwards produced.", "counter"
        )
        self.spec_draft_tokens = Scalar("spec_draft_tokens_total", "Draft tokens proposed.", "counter")
        self.spec_accepted_tokens = Scalar("spec_accepted_tokens_total", "Draft tokens accepted.", "counter")
        self.spec_accept_length = Scalar(
            "spec_accept_length",
            "Mean tokens per verify forward (accepted drafts + 1): spec_verify_tokens_total / spec_verify_ct_total.",
            "gauge",
        )
        self.spec_accept_rate = Scalar(
            "spec_accept_rate", "spec_accepted_tokens_total / spec_draft_tokens_total.", "gauge"
        )
        self.num_requests = PerReplicaCounter("num_requests_total", "Finished requests.", dp_size)
        self.num_aborted = PerReplicaCounter("num_aborted_requests_total", "Aborted requests.", dp_size)
        self.prompt_tokens = PerReplicaCounter(
            "prompt_tokens_total", "Prompt tokens of finished requests.", dp_size
        )
        self.generation_tokens = PerReplicaCounter("generation_tokens_total", "Generated tokens.", dp_size)
        self.cached_tokens = PerReplicaCounter(
            "cached_tokens_total", "Prompt tokens served by the prefix cache.", dp_size
        )
        self.num_running = Scalar("num_running_reqs", "Requests that produced a first token.", "gauge")
        self.num_queued = Scalar("num_queue_reqs", "Requests waiting for their first token.", "gauge")
        self.token_usage = Scalar(
            "token_usage", "Tokens held by in-flight requests / KV pool size (an upper bound).", "gauge"
        )
        self.cache_hit_rate = Scalar("cache_hit_rate", "cached_tokens_total / prompt_tokens_total.", "gauge")
        # With several replicas the TokenizerManager cannot tell which replica queues a request
        # before its first token, so the load gauges come from the replicas themselves.
        self.replica_running = PerReplicaCounter("num_running_reqs", self.num_running.help, dp_size, "gauge")
        self.replica_queued = PerReplicaCounter(
            "num_queue_reqs", "Requests in the waiting queue.", dp_size, "gauge"
        )
        self.replica_usage = PerReplicaCounter(
            "token_usage",
            "KV tokens held by requests and waiting prompts / the replica's pool.",
            dp_size,
            "gauge",
        )
        self.ttft = PerReplicaHistogram(
            "time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS, dp_size
        )
        self.itl = PerReplicaHistogram(
            "inter_token_latency_seconds", "Time between output chunks per token.", ITL_BUCKETS, dp_size
        )
        self.e2e = PerReplicaHistogram(
            "e2e_request_latency_seconds", "Request latency end to end.", LATENCY_BUCKETS, dp_size
        )
        self.queue_time = PerReplicaHistogram(
            "queue_time_seconds",
            "Time in the scheduler's waiting queue before the first prefill.",
            LATENCY_BUCKETS,
            dp_size,
        )

    def on_first_token(self, ttft: float, queue_time: float | None, dp_rank: int | None = None) -> None:
        self.ttft.observe(ttft, dp_rank)
        if queue_time is not None:
            self.queue_time.observe(queue_time, dp_rank)

    def on_tokens(self, num_new_tokens: int, interval: float | None, dp_rank: int | None = None) -> None:
        self.generation_tokens.add(num_new_tokens, dp_rank)
        if interval is not None and num_new_tokens > 0:
            per_token = interval / num_new_tokens
            for _ in range(num_new_tokens):
                self.itl.observe(per_token, dp_rank)

    def on_finish(
        self, prompt_tokens: int, cached_tokens: int, e2e: float, aborted: bool, dp_rank: int | None = None
    ) -> None:
        self.num_requests.add(1, dp_rank)
        self.num_aborted.add(int(aborted), dp_rank)
        self.prompt_tokens.add(prompt_tokens, dp_rank)
        self.cached_tokens.add(cached_tokens, dp_rank)
        self.e2e.observe(e2e, dp_rank)
        if self.prompt_tokens.value:
            self.cache_hit_rate.value = self.cached_tokens.value / self.prompt_tokens.value

    def on_spec(self, verify_ct: int, verify_tokens: int, num_drafts: int, num_accepted: int) -> None:
        """A finished request's speculative-decoding counters."""
        self.spec_verify_ct.value += verify_ct
        self.spec_verify_tokens.value += verify_tokens
        self.spec_draft_tokens.value += num_drafts
        self.spec_accepted_tokens.value += num_accepted
        if self.spec_verify_ct.value:
            self.spec_accept_length.value = self.spec_verify_tokens.value / self.spec_verify_ct.value
        if self.spec_draft_tokens.value:
            self.spec_accept_rate.value = self.spec_accepted_tokens.value / self.spec_draft_tokens.value

    def set_load(self, num_running: int, num_queued: int, tokens_in_flight: int) -> None:
        self.num_running.value = num_running
        self.num_queued.value = num_queued
        self.token_usage.value = min(1.0, tokens_in_flight / self.max_total_num_tokens)

    def set_replica_loads(self, loads: list[dict[str, int]]) -> None:
        """The replicas' /get_load entries (dp_rank, num_reqs, num_waiting_reqs, num_tokens)."""
        pool = self.max_total_num_tokens / self.dp_size
        for load in loads:
            d = _replica(load["dp_rank"], self.dp_size)
            self.replica_running.values[d] = load["num_reqs"] - load["num_waiting_reqs"]
            self.replica_queued.values[d] = load["num_waiting_reqs"]
            self.replica_usage.values[d] = min(1.0, load["num_tokens"] / pool)

    def render(self) -> str:
        gauges = (
            [self.num_running, self.num_queued, self.token_usage]
            if self.dp_size == 1
            else [self.replica_running, self.replica_queued, self.replica_usage]
        )
        parts: list[Scalar | PerReplicaCounter | PerReplicaHistogram] = [
            self.num_requests,
            self.num_aborted,
            self.prompt_tokens,
            self.generation_tokens,
            self.cached_tokens,
            self.cache_hit_rate,
            *gauges,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
        ]
        if self.speculative:
            parts += [
                self.spec_verify_ct,
                self.spec_verify_tokens,
                self.spec_draft_tokens,
                self.spec_accepted_tokens,
                self.spec_accept_length,
                self.spec_accept_rate,
            ]
        return (
            "\n".join(with_model_name([line for p in parts for line in p.render()], self.model_name)) + "\n"
        )
