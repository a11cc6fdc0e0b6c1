"""The scheduler's record of its recent batches, for the dashboard (/dashboard/state).

Bounded and per batch, never per request: `on_launch` reads three counts of the batch being
launched, `on_done` times the oldest launched batch whose result came back. Every executor
processes results in launch order (the sync loop at once, the overlap loop one step later, the
pipeline loop a slot's turn later), so a FIFO of launched batches pairs each result with its
launch. The counters only grow (a reader takes rates from two snapshots).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from radixserve.scheduler.req_timeline import TraceTimer
from radixserve.scheduler.schedule_batch import ScheduleBatch

# Batches kept for the dashboard's "recent batches" table and the per-rank step times.
BATCH_LOG_SIZE = 32


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch: when it was launched (time.time()), its forward mode, its requests, the
    tokens it computed (prefill = prompt tokens; decode = one per decoding request) and the
    milliseconds from its launch to its result being processed."""

    launched_at: float
    mode: str
    num_reqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    ms: float

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "launched_at": self.launched_at,
            "mode": self.mode,
            "num_reqs": self.num_reqs,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "ms": round(self.ms, 3),
        }


class BatchLog:
    def __init__(self, size: int = BATCH_LOG_SIZE, trace: bool = False) -> None:
        # --enable-trace: the traced requests' times ride on the same launch/result pairing.
        self.timer = TraceTimer() if trace else None
        self.recent: deque[BatchRecord] = deque(maxlen=size)
        # (wall time, perf_counter, mode, reqs, prefill tokens, decode tokens) of launched batches
        # whose results are not processed yet, oldest first.
        self._launched: deque[tuple[float, float, str, int, int, int]] = deque()
        self.num_batches = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    def on_launch(self, batch: ScheduleBatch) -> None:
        mode = batch.forward_mode
        num_reqs = len(batch.reqs)
        if mode.is_decode() or mode.is_target_verify():
            prefill, decode = 0, num_reqs
        else:  # extend, or mixed: the chunk's tokens plus one per riding decode
            decode = len(batch.decoding_reqs)
            prefill = batch.extend_num_tokens - decode
        self._launched.append(
            (time.time(), time.perf_counter(), mode.name.lower(), num_reqs, prefill, decode)
        )
        self.num_batches += 1
        self.num_prefill_tokens += prefill
        self.num_decode_tokens += decode
        if self.timer is not None:
            self.timer.on_launch(batch)

    def on_done(self) -> None:
        if self.timer is not None:
            self.timer.on_done()
        if not self._launched:  # a result of a batch launched before this log existed
            return
        wall, start, mode, num_reqs, prefill, decode = self._launched.popleft()
        self.recent.append(
            BatchRecord(wall, mode, num_reqs, prefill, decode, (time.perf_counter() - start) * 1e3)
        )

    def mean_ms(self) -> float | None:
        return sum(r.ms for r in self.recent) / len(self.recent) if self.recent else None

    def counters(self) -> dict[str, int]:
        return {
            "num_batches": self.num_batches,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
        }
