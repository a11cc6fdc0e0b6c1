"""The host KV tier (L2 of HiCache): K/V buffers in host memory, addressed by host slot like the
device pool, with their own page allocator.

Layouts (--hicache-mem-layout, SGLang's names):
- layer_first: one [size + page_size, num_kv_heads, head_dim] buffer per layer and per K/V, the
  device pool's own layout, so a copy is one index_copy per layer and direction;
- page_first (and page_first_direct, the same storage here): one
  [2, size + page_size, num_layers, num_kv_heads, head_dim] buffer in which a token's K/V of every
  layer is contiguous, the layout a storage tier would write as one block per page.
"""

from __future__ import annotations

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import MHATokenToKVPool


def host_pool_size(device_size: int, page_size: int, bytes_per_token: int, ratio: float, size_gb: int) -> int:
    """Tokens the host tier holds: --hicache-size GB when > 0, else ratio x the device pool; cut
    to whole pages. It must exceed the device pool: an L2 no larger than L1 could not hold what
    L1 evicts while L1 also mirrors it."""
    if size_gb > 0:
        tokens = int(size_gb * 1e9) // bytes_per_token
    else:
        tokens = int(device_size * ratio)
    tokens = tokens // page_size * page_size
    if tokens <= device_size:
        raise ValueError(
            f"The host KV tier ({tokens} tokens) must be larger than the device KV pool ({device_size} "
            f"tokens): raise --hicache-ratio or --hicache-size"
        )
    return tokens


class HostKVPool:
    def __init__(self, device_pool: MHATokenToKVPool, size: int, layout: str) -> None:
        self.device_pool = device_pool
        self.size = size
        self.page_size = device_pool.page_size
        self.layout = layout
        self.allocator = TokenToKVPoolAllocator(size, self.page_size)
        dp = device_pool
        # Pinned memory lets CUDA copies run asynchronously; on a CPU device it buys nothing.
        pin = dp.device.type == "cuda"
        rows = size + self.page_size  # page 0 is padding, as in the device pool
        if layout == "layer_first":
            shape = (rows, dp.num_kv_heads, dp.head_dim)
            self.k_buffer = [torch.zeros(shape, dtype=dp.dtype, pin_memory=pin) for _ in range(dp.num_layers)]
            self.v_buffer = [torch.zeros(shape, dtype=dp.dtype, pin_memory=pin) for _ in range(dp.num_layers)]
        elif layout in ("page_first", "page_first_direct"):
            shape5 = (2, rows, dp.num_layers, dp.num_kv_heads, dp.head_dim)
            self.kv_buffer = torch.zeros(shape5, dtype=dp.dtype, pin_memory=pin)
        else:
            raise ValueError(f"unknown host KV layout {layout!r}")
        self.bytes_per_token = MHATokenToKVPool.kv_bytes_per_token(
            dp.num_layers, dp.num_kv_heads, dp.head_dim, dp.dtype
        )

    def clear(self) -> None:
        self.allocator.clear()

    def write_from_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy the device pool's K/V at device_slots ([N] int64) into host_slots ([N] int64)."""
        dp, dev = self.device_pool, device_slots.to(self.device_pool.device)
        for layer in range(dp.num_layers):
            k = dp.k_buffer[layer].index_select(0, dev).to("cpu")  # [N, num_kv_heads, head_dim]
            v = dp.v_buffer[layer].index_select(0, dev).to("cpu")
            if self.layout == "layer_first":
                self.k_buffer[layer].index_copy_(0, host_slots, k)
                self.v_buffer[layer].index_copy_(0, host_slots, v)
            else:
                self.kv_buffer[0, host_slots, layer] = k
                self.kv_buffer[1, host_slots, layer] = v

    def read_to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy host_slots' K/V ([N] int64) into the device pool at device_slots ([N] int64)."""
        dp, dev = self.device_pool, device_slots.to(self.device_pool.device)
        if self.layout != "layer_first":
            block = self.kv_buffer[:, host_slots]  # [2, N, num_layers, num_kv_heads, head_dim]: one gather
        for layer in range(dp.num_layers):
            if self.layout == "layer_first":
                k = self.k_buffer[layer].index_select(0, host_slots)
                v = self.v_buffer[layer].index_select(0, host_slots)
            else:
                k, v = block[0, :, layer], block[1, :, layer]
            dp.k_buffer[layer].index_copy_(0, dev, k.to(dp.device, non_blocking=True))
            dp.v_buffer[layer].index_copy_(0, dev, v.to(dp.device, non_blocking=True))

    def size_bytes(self) -> int:
        if self.layout == "layer_first":
            return sum(t.numel() * t.element_size() for t in (*self.k_buffer, *self.v_buffer))
        return self.kv_buffer.numel() * self.kv_buffer.element_size()
