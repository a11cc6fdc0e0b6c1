"""The prefill admission gate for LoRA (SGLang's `can_run_lora_batch`): a forward never holds more
distinct adapters than --max-loras-per-batch, the compute pool's slots.

The running batch decodes in the same forward as whatever joins it, so its adapters count. A
waiting request whose adapter would be one too many is skipped this round and stays in the queue
(it waits; it never fails): later requests of the base model or of adapters already in the batch
may still join. The base model takes no slot.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class HasLoRA(Protocol):
    lora_id: str | None


class LoRABatchGate:
    def __init__(self, max_loras_per_batch: int) -> None:
        self.max_loras_per_batch = max_loras_per_batch

    def adapters_of(self, reqs: Iterable[HasLoRA]) -> set[str]:
        """The adapters a batch of `reqs` holds."""
        return {r.lora_id for r in reqs if r.lora_id is not None}

    def admits(self, req: HasLoRA, present: set[str]) -> bool:
        """Whether `req` may join a batch holding the adapters `present`."""
        lora = req.lora_id
        return lora is None or lora in present or len(present) < self.max_loras_per_batch
