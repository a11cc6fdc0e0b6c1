"""A CPU stand-in for CUDA-graph capture, so the graph runner's bucketing, padding and slicing can
be checked without a GPU.

A real graph replays the captured kernels over the static buffers as they are at replay time; the
stand-in gets the same semantics by re-running the captured function over those same buffers and
copying the result into the static output tensor. It records every call, so a test can see which
padded batch size ran and what the static inputs held at that moment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class EagerGraph:
    run: Callable[[], torch.Tensor]
    out: torch.Tensor  # [bs, ...] the static output, overwritten by each replay
    on_replay: Callable[[int], None]

    def replay(self) -> None:
        self.on_replay(self.out.shape[0])
        self.out.copy_(self.run())


@dataclass
class EagerGraphFactory:
    captured_bs: list[int] = field(default_factory=list)  # in capture order
    replayed_bs: list[int] = field(default_factory=list)
    # Called with the padded bs right before each replay runs (e.g. to snapshot the buffers).
    before_replay: Callable[[int], None] | None = None

    def capture(self, run: Callable[[], torch.Tensor]) -> tuple[EagerGraph, torch.Tensor]:
        out = run().clone()
        self.captured_bs.append(out.shape[0])
        return EagerGraph(run, out, self._record), out

    def _record(self, bs: int) -> None:
        self.replayed_bs.append(bs)
        if self.before_replay is not None:
            self.before_replay(bs)
