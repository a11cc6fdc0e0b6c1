"""The rows of a batch whose requests use a custom logit processor, kept row-aligned with the
SamplingBatchInfo (filtered and merged with it) and applied by the sampler."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class CustomRows:
    processors: list[Any]  # per row: a CustomLogitProcessor, or None
    params: list[dict[str, Any] | None]  # per row: sampling_params.custom_params
    reqs: list[Any]  # per row: the scheduler's Req (SGLang's "__req__"), None where no processor

    @classmethod
    def from_reqs(cls, reqs: Sequence[Any]) -> CustomRows | None:
        processors = [getattr(r, "custom_logit_processor", None) for r in reqs]
        if all(p is None for p in processors):
            return None
        params = [r.sampling_params.custom_params for r in reqs]
        return cls(processors, params, [r if p is not None else None for r, p in zip(reqs, processors)])

    def filter(self, keep_indices: list[int]) -> CustomRows | None:
        kept = CustomRows(
            *([xs[i] for i in keep_indices] for xs in (self.processors, self.params, self.reqs))
        )
        return kept if any(p is not None for p in kept.processors) else None

    @staticmethod
    def merge(a: CustomRows | None, b: CustomRows | None, bs_a: int, bs_b: int) -> CustomRows | None:
        if a is None and b is None:
            return None
        a = a or CustomRows([None] * bs_a, [None] * bs_a, [None] * bs_a)
        b = b or CustomRows([None] * bs_b, [None] * bs_b, [None] * bs_b)
        return CustomRows(a.processors + b.processors, a.params + b.params, a.reqs + b.reqs)

    def apply(self, logits: torch.Tensor) -> None:
        """Each processor on its rows ([k, vocab], in place). A processor that raises leaves its
        rows NaN: the sampler then finishes those requests with an error, the rest go on."""
        groups: dict[int, tuple[Any, list[int]]] = {}
        for row, proc in enumerate(self.processors):
            if proc is not None:
                groups.setdefault(id(proc), (proc, []))[1].append(row)
        for proc, rows in groups.values():
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            params = [{**(self.params[i] or {}), "__req__": self.reqs[i]} for i in rows]
            try:
                logits[index] = proc(logits.index_select(0, index), params)
            except Exception:  # the processor's code, not the server's: its requests fail alone
                logger.exception("Custom logit processor %s failed", type(proc).__name__)
                logits[index] = float("nan")
