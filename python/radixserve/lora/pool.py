"""The compute pool: --max-loras-per-batch slots of adapter weights next to the model.

Per adapted projection and layer, A is [num_slots, max_rank, in_features] and B
[num_slots, max_rank, out_features], allocated once at start (no allocation while serving). An
adapter of rank r fills the first r ranks of its slot; the rest stays zero, so every slot has the
same shape and a smaller rank adds exact zeros. Slots are handed out least recently used first,
never one an adapter of the batch being prepared holds.
"""

from __future__ import annotations

import itertools

import torch

from radixserve.lora.adapter import LoRAAdapter
from radixserve.lora.tp_shards import Slices


class LoRASlots:
    """Which adapter sits in which slot, with LRU eviction of adapters the current batch does not use."""

    def __init__(self, num_slots: int) -> None:
        self.names: list[str | None] = [None] * num_slots
        self._last_use = [0] * num_slots
        self._clock = itertools.count(1)

    def slot_of(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def assign(self, wanted: set[str]) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """Slots for every adapter in `wanted` (at most num_slots of them). Returns {name: slot} and
        the (slot, name) pairs whose weights must be copied in now."""
        if len(wanted) > len(self.names):
            raise RuntimeError(
                f"a batch uses {len(wanted)} adapters, above --max-loras-per-batch {len(self.names)}"
            )
        slots, to_load = {}, []
        for name in sorted(wanted):  # sorted: every rank assigns alike
            slot = self.slot_of(name)
            if slot is None:
                slot = self._victim(wanted)
                self.names[slot] = name
                to_load.append((slot, name))
            self._last_use[slot] = next(self._clock)
            slots[name] = slot
        return slots, to_load

    def _victim(self, wanted: set[str]) -> int:
        free = [i for i, n in enumerate(self.names) if n is None]
        if free:
            return free[0]
        candidates = [i for i, n in enumerate(self.names) if n not in wanted]
        return min(candidates, key=lambda i: self._last_use[i])

    def drop(self, name: str) -> None:
        slot = self.slot_of(name)
        if slot is not None:
            self.names[slot] = None


class LoRAMemoryPool:
    """The slot buffers: a[module][layer] [num_slots, max_rank, in], b[module][layer] [num_slots, max_rank, out],
    in and out being this rank's part of the projection (`slices`; the whole one at TP 1)."""

    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        modules: tuple[str, ...],
        shapes: dict[str, tuple[int, int]],
        slices: Slices,
        layers: range,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers = layers
        self.slices = slices
        self.a: dict[str, dict[int, torch.Tensor]] = {}
        self.b: dict[str, dict[int, torch.Tensor]] = {}
        for module in modules:
            in_f, out_f = shapes[module]
            self.a[module] = {
                i: torch.zeros(num_slots, max_rank, in_f, dtype=dtype, device=device) for i in layers
            }
            self.b[module] = {
                i: torch.zeros(num_slots, max_rank, out_f, dtype=dtype, device=device) for i in layers
            }

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot` (zeros wherever it adapts nothing)."""
        for module, per_layer in self.a.items():
            for layer in self.layers:
                a, b = per_layer[layer][slot], self.b[module][layer][slot]  # [max_rank, in], [max_rank, out]
                a.zero_()
                b.zero_()
                pair = adapter.weights.get((layer, module))
                if pair is not None:  # A [rank, in], B [out, rank]: this rank's columns / rows
                    cols, rows = self.slices[module]
                    a[: adapter.rank].copy_(pair[0][:, cols])
                    b[: adapter.rank].copy_(pair[1][rows].t())
