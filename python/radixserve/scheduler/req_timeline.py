"""--enable-trace in the scheduler: when a traced request waited, ran its prefill chunks and decoded.

The scheduler exports no spans itself: it keeps a few timestamps per traced request and sends
them back once, with the request's final output (`ReqTrace` on BatchTokenIDOut, passed on by the
detokenizer); the HTTP process, which already holds the request's span and the exporter, turns
them into spans (utils/tracing.py). So the scheduler process needs no OpenTelemetry and no
exporter thread, and a request without a trace context costs nothing here: only requests that
carry one get a `ReqTimeline`, and the timer exists only with --enable-trace.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from radixserve.managers.io_struct import ReqTrace

if TYPE_CHECKING:
    from radixserve.scheduler.schedule_batch import ScheduleBatch


class ReqTimeline:
    """One traced request's times (time.time() seconds), filled in by the TraceTimer."""

    __slots__ = ("arrived", "first_scheduled", "chunks", "decode_start", "decode_end", "num_decode_steps")

    def __init__(self) -> None:
        self.arrived = time.time()
        self.first_scheduled: float | None = None
        self.chunks: list[tuple[float, float, int]] = []  # (launch, result processed, prompt tokens)
        self.decode_start: float | None = None
        self.decode_end: float | None = None
        self.num_decode_steps = 0

    def export(self) -> ReqTrace:
        return ReqTrace(
            arrived=self.arrived,
            first_scheduled=self.first_scheduled,
            chunks=tuple(self.chunks),
            decode_start=self.decode_start,
            decode_end=self.decode_end,
            num_decode_steps=self.num_decode_steps,
            sent=time.time(),
        )


# A launched batch: its launch time and, per traced request in it, its timeline and the prompt
# tokens it computes (None: it decodes in this batch).
_Launched = tuple[float, list[tuple[ReqTimeline, int | None]]]


class TraceTimer:
    """Times traced requests per batch. Every executor processes results in launch order (as the
    BatchLog relies on too), so a FIFO of launched batches pairs each result with its launch."""

    def __init__(self) -> None:
        self._launched: deque[_Launched] = deque()

    def on_launch(self, batch: ScheduleBatch) -> None:
        now = time.time()
        mode = batch.forward_mode
        all_decode = mode.is_decode() or mode.is_target_verify()
        riding = {id(r) for r in batch.decoding_reqs}  # the decodes of a mixed batch
        traced: list[tuple[ReqTimeline, int | None]] = []
        for i, req in enumerate(batch.reqs):
            timeline = req.timeline
            if timeline is None:
                continue
            if all_decode or id(req) in riding:
                if timeline.decode_start is None:
                    timeline.decode_start = now
                timeline.num_decode_steps += 1
                traced.append((timeline, None))
            else:
                if timeline.first_scheduled is None:
                    timeline.first_scheduled = now
                traced.append((timeline, batch.extend_lens[i]))
        self._launched.append((now, traced))

    def on_done(self) -> None:
        if not self._launched:  # a result of a batch launched before this timer existed
            return
        launched, traced = self._launched.popleft()
        now = time.time()
        for timeline, num_tokens in traced:
            if num_tokens is None:
                timeline.decode_end = now
            else:
                timeline.chunks.append((launched, now, num_tokens))
