"""Moves KV between the device pool (L1) and the host tier (L2) in batches, and counts it.

Every call moves one batch: the tree gathers all the pages of an eviction round, an insert or a
load-back into one slot list, so the per-layer copies run once per batch, not once per node. The
copies run synchronously on the scheduler thread: on a CPU both tiers are RAM, and a batch costs
a few percent of the prefill it saves (docs/hicache.md has the measurement), which a background
thread competing with the forward for the same cores would not win back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from radixserve.mem_cache.host_pool import HostKVPool


@dataclass
class MoverStats:
    """Cumulative traffic between the tiers (counters: /flush_cache does not reset them)."""

    num_backup_tokens: int = 0  # device -> host
    backup_bytes: int = 0
    backup_time_s: float = 0.0
    num_load_back_tokens: int = 0  # host -> device
    load_back_bytes: int = 0
    load_back_time_s: float = 0.0
    num_backup_batches: int = 0
    num_load_back_batches: int = 0


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
        if device_slots.numel() != host_slots.numel():
            raise ValueError(
                f"backup: {device_slots.numel()} device slots for {host_slots.numel()} host slots"
            )
        if device_slots.numel() == 0:
            return
        start = time.perf_counter()
        with one_intra_op_thread(self.on_cpu):
            self.host_pool.write_from_device(host_slots, device_slots)
        s = self.stats
        s.backup_time_s += time.perf_counter() - start
        s.num_backup_tokens += host_slots.numel()
        s.backup_bytes += host_slots.numel() * self.host_pool.bytes_per_token
        s.num_backup_batches += 1

    def load_back(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy one batch host -> device ([N] int64 slots each); done when this returns (a CUDA
        copy is queued on the current stream, ahead of the forward that reads it)."""
        if device_slots.numel() != host_slots.numel():
            raise ValueError(
                f"load_back: {host_slots.numel()} host slots for {device_slots.numel()} device slots"
            )
        if host_slots.numel() == 0:
            return
        start = time.perf_counter()
        with one_intra_op_thread(self.on_cpu):
            self.host_pool.read_to_device(host_slots, device_slots)
        s = self.stats
        s.load_back_time_s += time.perf_counter() - start
        s.num_load_back_tokens += host_slots.numel()
        s.load_back_bytes += host_slots.numel() * self.host_pool.bytes_per_token
        s.num_load_back_batches += 1
