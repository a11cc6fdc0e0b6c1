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

from radixserve.mem_cache import cpu_alloc
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.kv_dtype import index_copy_rows_
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


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Pinned memory is touched when it is pinned; unpinned host memory comes lazily."""
    return torch.zeros(shape, dtype=dtype, pin_memory=True) if pin else cpu_alloc.zeros(shape, dtype)


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
            self.k_buffer = [_zeros(shape, dp.dtype, pin) for _ in range(dp.num_layers)]
            self.v_buffer = [_zeros(shape, dp.dtype, pin) for _ in range(dp.num_layers)]
        elif layout in ("page_first", "page_first_direct"):
            shape5 = (2, rows, dp.num_layers, dp.num_kv_heads, dp.head_dim)
            self.kv_buffer = _zeros(shape5, dp.dtype, pin)
        else:
            raise ValueError(f"unknown host KV layout {layout!r}")
        self._buffers: dict[tuple[bool, int], torch.Tensor] = {}
        self.bytes_per_token = MHATokenToKVPool.kv_bytes_per_token(
            dp.num_layers, dp.num_kv_heads, dp.head_dim, dp.dtype
        )

    def clear(self) -> None:
        self.allocator.clear()

    # Copies go through 2-D row views ([rows, num_kv_heads * head_dim]) and reused staging
    # buffers: on CPU, index_copy_ of 3-D rows and freshly allocated temporaries (page faults)
    # each cost several times the copy itself (docs/hicache.md).

    def _stage(self, num_tokens: int, wide: bool) -> torch.Tensor:
        """A [num_tokens, row] buffer (row: one layer's K of a token, or all layers' when wide)."""
        dp = self.device_pool
        row = dp.num_kv_heads * dp.head_dim * (dp.num_layers if wide else 1)
        key = (wide, row)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < num_tokens:
            buf = torch.empty((max(num_tokens, 256), row), dtype=dp.dtype)
            self._buffers[key] = buf
        return buf[:num_tokens]

    def write_from_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy the device pool's K/V at device_slots ([N] int64) into host_slots ([N] int64)."""
        dp, n = self.device_pool, host_slots.numel()
        dev = device_slots.to(dp.device)
        buf = self._stage(n, wide=False)  # [N, heads * head_dim]
        wide = None if self.layout == "layer_first" else self._stage(n, wide=True).view(n, dp.num_layers, -1)
        for kv, (dev_bufs, host_bufs) in enumerate(
            ((dp.k_buffer, self._k_rows()), (dp.v_buffer, self._v_rows()))
        ):
            for layer in range(dp.num_layers):
                src = dev_bufs[layer].view(dev_bufs[layer].shape[0], -1)
                if dp.device.type == "cpu":
                    torch.index_select(src, 0, dev, out=buf)
                else:
                    buf.copy_(src.index_select(0, dev))
                if wide is None:
                    index_copy_rows_(host_bufs[layer], 0, host_slots, buf)
                else:
                    wide[:, layer] = buf
            if wide is not None:  # one scatter of whole-token rows per K / V
                index_copy_rows_(
                    self.kv_buffer[kv].view(self.kv_buffer.shape[1], -1), 0, host_slots, wide.view(n, -1)
                )

    def read_to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy host_slots' K/V ([N] int64) into the device pool at device_slots ([N] int64)."""
        dp, n = self.device_pool, host_slots.numel()
        dev = device_slots.to(dp.device)
        buf = self._stage(n, wide=False)
        wide = None if self.layout == "layer_first" else self._stage(n, wide=True).view(n, dp.num_layers, -1)
        for kv, (dev_bufs, host_bufs) in enumerate(
            ((dp.k_buffer, self._k_rows()), (dp.v_buffer, self._v_rows()))
        ):
            if wide is not None:  # one gather of whole-token rows per K / V
                torch.index_select(
                    self.kv_buffer[kv].view(self.kv_buffer.shape[1], -1), 0, host_slots, out=wide.view(n, -1)
                )
            for layer in range(dp.num_layers):
                if wide is None:
                    torch.index_select(host_bufs[layer], 0, host_slots, out=buf)
                else:
                    buf.copy_(wide[:, layer])
                dst = dev_bufs[layer].view(dev_bufs[layer].shape[0], -1)
                index_copy_rows_(dst, 0, dev, buf.to(dp.device, non_blocking=True))

    def read_tokens(self, host_slots: torch.Tensor) -> torch.Tensor:
        """A copy of host_slots' K/V ([N] int64) as [N, 2, num_layers, num_kv_heads, head_dim]:
        the token-major form L3 page files hold."""
        if self.layout == "layer_first":
            k = torch.stack([b.index_select(0, host_slots) for b in self.k_buffer], dim=1)
            v = torch.stack([b.index_select(0, host_slots) for b in self.v_buffer], dim=1)
            return torch.stack([k, v], dim=1)
        return self.kv_buffer.index_select(1, host_slots).transpose(0, 1).contiguous()

    def write_tokens(self, host_slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store kv ([N, 2, num_layers, num_kv_heads, head_dim], read_tokens' form) at host_slots."""
        if self.layout == "layer_first":
            for layer in range(len(self.k_buffer)):
                index_copy_rows_(self.k_buffer[layer], 0, host_slots, kv[:, 0, layer])
                index_copy_rows_(self.v_buffer[layer], 0, host_slots, kv[:, 1, layer])
            return
        index_copy_rows_(self.kv_buffer, 1, host_slots, kv.transpose(0, 1))

    def _k_rows(self) -> list[torch.Tensor]:
        """layer_first's K buffers as [rows, heads * head_dim] views (empty for page_first)."""
        return [b.view(b.shape[0], -1) for b in self.k_buffer] if self.layout == "layer_first" else []

    def _v_rows(self) -> list[torch.Tensor]:
        return [b.view(b.shape[0], -1) for b in self.v_buffer] if self.layout == "layer_first" else []

    def size_bytes(self) -> int:
        if self.layout == "layer_first":
            return sum(t.numel() * t.element_size() for t in (*self.k_buffer, *self.v_buffer))
        return self.kv_buffer.numel() * self.kv_buffer.element_size()
