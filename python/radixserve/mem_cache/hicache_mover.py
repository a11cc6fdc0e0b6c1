"""Moves KV between the device pool (L1) and the host tier (L2) in batches, and counts it.

Every call moves one batch: the tree gathers all the pages of an eviction round, an insert or a
load-back into one slot list, so the per-layer copies run once per batch, not once per node. The
copies run synchronously on the scheduler thread: on a CPU both tiers are RAM, and a batch costs
a few percent of the prefill it saves (docs/hicache.md has the measurement), which a background
thread competing with the forward for the same cores would not win back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from radixserve.mem_cache.host_pool import HostKVPool


@dataclass
class Traffic:
    """Cumulative copies in one direction (counters: /flush_cache does not reset them)."""

    tokens: int = 0
    bytes: int = 0
    time_s: float = 0.0
    batches: int = 0


@dataclass
class MoverStats:
    backup: Traffic = field(default_factory=Traffic)  # device -> host
    load_back: Traffic = field(default_factory=Traffic)  # host -> device


@contextmanager
def one_intra_op_thread(enabled: bool) -> Iterator[None]:
    """Run the copies on the calling thread alone. They are memory-bound, and on a loaded CPU the
    intra-op pool's barriers cost more than a second core gains (docs/hicache.md: 2000 tokens of
    SmolLM2's KV moved in 60 ms on one thread, 150-200 ms on two while the cores were busy)."""
    num = torch.get_num_threads()
    if not enabled or num == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num)


class HiCacheMover:
    def __init__(self, host_pool: HostKVPool) -> None:
        self.host_pool = host_pool
        self.stats = MoverStats()
        self.on_cpu = host_pool.device_pool.device.type == "cpu"

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy one batch device -> host ([N] int64 slots each)."""
        self._copy("backup", self.stats.backup, host_slots, device_slots, self.host_pool.write_from_device)

    def load_back(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy one batch host -> device ([N] int64 slots each); done when this returns (a CUDA
        copy is queued on the current stream, ahead of the forward that reads it)."""
        self._copy("load_back", self.stats.load_back, host_slots, device_slots, self.host_pool.read_to_device)

    def _copy(
        self,
        what: str,
        traffic: Traffic,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        copy: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> None:
        n = host_slots.numel()
        if device_slots.numel() != n:
            raise ValueError(f"{what}: {device_slots.numel()} device slots for {n} host slots")
        if n == 0:
            return
        start = time.perf_counter()
        with one_intra_op_thread(self.on_cpu):
            copy(host_slots, device_slots)
        traffic.time_s += time.perf_counter() - start
        traffic.tokens += n
        traffic.bytes += n * self.host_pool.bytes_per_token
        traffic.batches += 1
