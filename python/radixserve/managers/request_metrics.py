"""The TokenizerManager's Prometheus updates, from its per-request states (utils/metrics.py)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from radixserve.managers.io_struct import FinishAbort, FinishReason
from radixserve.managers.req_state import ReqState
from radixserve.utils.metrics import ServerMetrics


def observe_output(metrics: ServerMetrics, state: ReqState, num_new: int, first: bool, now: float) -> None:
    """New tokens of `state` received at `now` (perf_counter); before state.last_token_time moves."""
    if first:
        metrics.on_first_token(now - state.created_time, state.queue_time, state.dp_rank)
    metrics.on_tokens(num_new, None if first else now - (state.last_token_time or now), state.dp_rank)


def observe_finish(metrics: ServerMetrics, state: ReqState, reason: FinishReason) -> None:
    metrics.on_finish(
        state.prompt_tokens or len(state.input_ids),
        state.cached_tokens,
        time.perf_counter() - state.created_time,
        aborted=isinstance(reason, FinishAbort),
        dp_rank=state.dp_rank,
    )
    if state.spec is not None:
        metrics.on_spec(*state.spec)


def observe_load(metrics: ServerMetrics, states: Iterable[ReqState]) -> None:
    """The in-flight gauges: requests with / without output yet, and their tokens."""
    states = list(states)
    running = sum(1 for s in states if s.first_token_time is not None)
    tokens = sum(len(s.input_ids) + len(s.output_ids) for s in states)
    metrics.set_load(running, len(states) - running, tokens)
