"""Which experts the router picks (SGLang's ExpertDistributionRecorder, its "stat" mode): between
/start_expert_distribution_record and /stop_expert_distribution_record, every sparse layer adds the
top-k choices of every token the forward computes (prompt, decode and verified draft tokens) to
this forward pass's [num_layers, num_experts] counts; each pass's counts become one row of a ring
of the last `buffer_size` passes. /dump_expert_distribution_record writes the rows as SGLang does:
`{"rank", "logical_count": int64 [num_passes, num_layers, num_experts], ...}` with torch.save to
`$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_<time>.pt` (default /tmp),
then starts a new ring. Dense layers' rows stay 0.

Recording costs nothing when off (one attribute read per sparse layer); on, a bincount per layer.
The forward may run on another thread (the overlap loop) than the control request: the ring is
guarded by a lock, and a pass's counts move into it only when the pass ends.

With --enable-expert-distribution-metrics the recorder also keeps running totals of every pass's
counts (whether or not a record is on), which /metrics reads as
`sglang:moe_expert_tokens_total{layer, expert}` (utils/expert_metrics.py): the same bincount per
layer, plus one add of the pass's [num_layers, num_experts] counts to the totals.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

DUMP_DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"  # SGLang's variable, so its tools find the files
RECORDER_MODES = ("stat",)  # SGLang's per-token / per-pass / stat_approx modes are not served


class ExpertDistributionRecorder:
    def __init__(
        self, num_layers: int, num_experts: int, buffer_size: int, device: torch.device, metrics: bool = False
    ) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.recording = False
        self.metrics = metrics  # keep running totals for /metrics
        self._totals = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # on the CPU
        self._current = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._touched = False  # the current pass added something
        self._passes: deque[torch.Tensor] = deque(maxlen=None if buffer_size < 0 else buffer_size)
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether the sparse layers report their choices (a record is on, or the metrics)."""
        return self.recording or self.metrics

    def on_select(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """A sparse layer's top-k expert ids [num_tokens, top_k] of this pass."""
        self._current[layer_id] += torch.bincount(topk_ids.flatten(), minlength=self.num_experts)
        self._touched = True

    def discard_pass(self) -> None:
        """A forward that stopped between layers (StepYielded): its partial counts are dropped."""
        self._current.zero_()
        self._touched = False

    def end_pass(self) -> None:
        """After each forward: the pass's counts become a row of the ring."""
        if not self._touched:
            return
        row = self._current.to("cpu", copy=True)  # a copy: the buffer is zeroed for the next pass
        self._current.zero_()
        self._touched = False
        with self._lock:
            if self.metrics:
                self._totals += row
            if self.recording:  # a pass that straddled the stop is dropped with it
                self._passes.append(row)

    def start(self) -> None:
        with self._lock:
            self._passes.clear()
            self.recording = True

    def stop(self) -> None:
        with self._lock:
            self.recording = False

    def totals(self) -> torch.Tensor:
        """Every pass's counts since start, summed: int64 [num_layers, num_experts] (a copy)."""
        with self._lock:
            return self._totals.clone()

    def take(self) -> torch.Tensor:
        """The recorded passes' rows [num_passes, num_layers, num_experts]; the ring starts over."""
        with self._lock:
            rows, self._passes = list(self._passes), deque(maxlen=self._passes.maxlen)
        if not rows:
            return torch.zeros(0, self.num_layers, self.num_experts, dtype=torch.int64)
        return torch.stack(rows)


def dump_to_file(logical_count: torch.Tensor, rank: int) -> str:
    """SGLang's file: the same name, keys and tensor layout. Returns the path written."""
    folder = os.environ.get(DUMP_DIR_ENV, "/tmp")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"expert_distribution_recorder_{time.time()}.pt")
    output: dict[str, Any] = {
        "rank": rank,
        "logical_count": logical_count,
        "average_utilization_rate_over_window": None,  # SGLang's EPLB metric: not measured here
    }
    torch.save(output, path)
    logger.info("Wrote the expert distribution (%d passes) to %s", logical_count.shape[0], path)
    return path


def attach_recorder(
    model: nn.Module, num_layers: int, buffer_size: int, device: torch.device, metrics: bool = False
) -> ExpertDistributionRecorder:
    """A recorder wired into every sparse MoE block of `model` (ValueError for a dense model)."""
    blocks = [m for m in model.modules() if hasattr(m, "expert_recorder")]
    if not blocks:
        flag = "--enable-expert-distribution-metrics" if metrics else "--expert-distribution-recorder-mode"
        raise ValueError(f"{flag} records a mixture-of-experts model's routing; this model has no MoE layer")
    recorder = ExpertDistributionRecorder(num_layers, blocks[0].num_experts, buffer_size, device, metrics)
    for block in blocks:
        block.expert_recorder = recorder
    return recorder
