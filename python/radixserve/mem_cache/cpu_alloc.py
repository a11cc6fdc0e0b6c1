"""Zeroed KV buffers that cost nothing until they are used.

`torch.zeros` writes every byte: a CPU KV pool sized at a fifth of the machine's RAM (4.5 GiB for
a tiny test model, several GiB for a real one) took 5-9 s of a server's start-up here, touching
pages that a request may never reach, and pushing the page cache (the model's own files among
it) out of RAM for nothing. A private anonymous mapping is zero by the kernel's contract and gets
its pages on first write, so the pool's pages arrive as the radix cache fills them; reading a page
never written sees zeros, as `torch.zeros` promised.

The cost of laziness: RAM the pool was sized from is not reserved, so another process may take it
first and the pool's later pages then fail as any allocation would (the OOM killer). The budget
(`CPU_KV_RAM_FRACTION` of available RAM) leaves the rest of the machine room for that reason.
"""

from __future__ import annotations

import math
import mmap

import torch

# Below this a buffer is allocated normally: a mapping per small tensor would only waste page
# granularity and file descriptors of the address space for no measurable start-up time.
LAZY_MIN_BYTES = 1 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zero-filled tensor; on CPU, one backed by fresh anonymous memory (pages on first write)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # MAP_PRIVATE: Python's default for an anonymous map is MAP_SHARED, which would put the pool in
    # shmem (counted as shared memory, inherited writable across fork) instead of private RAM.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds a reference to the mapping; it is unmapped when the last view is freed.
    return torch.frombuffer(buf, dtype=dtype).view(shape)
