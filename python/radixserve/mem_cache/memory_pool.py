"""The two lower levels of KV memory (seed 004).

- ``ReqToTokenPool`` (addressing): one row per running request, column = token position,
  value = KV slot. Attention reads ``req_to_token[req_pool_idx, :seq_len]`` to gather a request's
  KV from anywhere in the pool, so slots need not be contiguous.
- ``MHATokenToKVPool`` (physical): per-layer K and V buffers indexed by slot, in the model dtype
  or the --kv-cache-dtype (mem_cache/kv_dtype.py: bf16, fp8, or int8 with per-row scales).
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.mem_cache import cpu_alloc
from radixserve.mem_cache.kv_dtype import (
    bytes_per_element_row,
    dequantize,
    has_scales,
    index_copy_rows_,
    quantize_int8,
    to_storage,
)


class ReqToTokenPool:
    """``[size, max_context_len]`` int32 slot table plus a free list of rows."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # int32 halves the table's footprint; slot ids fit easily (pools are < 2**31 tokens).
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._host_source: torch.Tensor | None = None
        self._host_table: np.ndarray | None = None
        self.clear()

    def host_table(self) -> np.ndarray | None:
        """req_to_token as numpy, sharing its memory, when it lives on the CPU (else None): a decode
        step reads and writes a few entries per request, which numpy does for a fraction of a small
        torch op's cost (mem_cache/allocator.py says why that matters)."""
        table = self.req_to_token
        if table.device.type != "cpu":
            return None
        if self._host_source is not table:  # made again if the table was ever replaced
            self._host_table, self._host_source = table.numpy(), table
        return self._host_table

    def clear(self) -> None:
        # A stack popped from the end; built reversed so low row ids come out first (readable logs).
        self._free_rows: list[int] = list(range(self.size - 1, -1, -1))
        self._row_is_free = [True] * self.size

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, need_size: int) -> list[int] | None:
        """``need_size`` free row indices, or None (nothing taken) when too few are free."""
        if need_size > len(self._free_rows):
            return None
        if need_size <= 0:
            return []
        rows = self._free_rows[-need_size:][::-1]
        del self._free_rows[-need_size:]
        for r in rows:
            self._row_is_free[r] = False
        return rows

    def free(self, free_index: int | list[int]) -> None:
        """Return rows to the pool; freeing a row that is already free raises."""
        rows = [free_index] if isinstance(free_index, int) else list(free_index)
        for r in rows:
            if not 0 <= r < self.size:
                raise ValueError(f"req_pool_idx {r} outside [0, {self.size})")
            if self._row_is_free[r]:
                raise RuntimeError(f"double free of req_pool_idx {r}")
            self._row_is_free[r] = True
            self._free_rows.append(r)


class MHATokenToKVPool:
    """Per-layer K/V buffers ``[size + page_size, num_kv_heads, head_dim]`` of ``dtype`` (the storage
    dtype; torch.int8 pools also hold fp32 scales ``[size + page_size, num_kv_heads]`` per layer,
    value = int8 * scale).

    Rows 0 .. page_size-1 (page 0) are padding that the allocator never hands out, so kernels can
    use slot 0 as a harmless write target for padded tokens.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: str | torch.device,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        shape = (size + page_size, num_kv_heads, head_dim)
        self.k_buffer: list[torch.Tensor] = [
            cpu_alloc.zeros(shape, dtype, self.device) for _ in range(num_layers)
        ]
        self.v_buffer: list[torch.Tensor] = [
            cpu_alloc.zeros(shape, dtype, self.device) for _ in range(num_layers)
        ]
        # int8: [size + page_size, num_kv_heads] fp32 per layer (unwritten rows: 0 * 0, read as 0).
        scale_shape = shape[:2]
        self.k_scale_buffer: list[torch.Tensor] | None = None
        self.v_scale_buffer: list[torch.Tensor] | None = None
        if has_scales(dtype):
            self.k_scale_buffer = [
                cpu_alloc.zeros(scale_shape, torch.float32, self.device) for _ in range(num_layers)
            ]
            self.v_scale_buffer = [
                cpu_alloc.zeros(scale_shape, torch.float32, self.device) for _ in range(num_layers)
            ]

    @staticmethod
    def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V that one token occupies across all layers (for sizing from a budget),
        an int8 pool's scales included."""
        return 2 * num_layers * num_kv_heads * bytes_per_element_row(dtype, head_dim)

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K bytes, V bytes) actually allocated, padding page (and int8 scales) included."""
        k = sum(t.numel() * t.element_size() for t in (*self.k_buffer, *(self.k_scale_buffer or [])))
        v = sum(t.numel() * t.element_size() for t in (*self.v_buffer, *(self.v_scale_buffer or [])))
        return k, v

    def get_kv_scale_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) [size + page_size, num_kv_heads] fp32 of an int8 pool; None otherwise."""
        if self.k_scale_buffer is None or self.v_scale_buffer is None:
            return None
        return self.k_scale_buffer[layer_id], self.v_scale_buffer[layer_id]

    def read_kv(
        self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots ``loc`` ([N] int64), dequantized to ``dtype``: [N, num_kv_heads, head_dim]
        each (the torch-native reference reads the pool through this)."""
        scales = self.get_kv_scale_buffer(layer_id)
        k = self.k_buffer[layer_id].index_select(0, loc)
        v = self.v_buffer[layer_id].index_select(0, loc)
        if scales is None:
            return k.to(dtype), v.to(dtype)
        return (
            dequantize(k, scales[0].index_select(0, loc), dtype),
            dequantize(v, scales[1].index_select(0, loc), dtype),
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v ([N, num_kv_heads, head_dim]) into slots ``loc`` ([N] int64), quantized to the
        pool dtype (a cast; fp8 saturates; int8 with a fresh scale per row)."""
        loc = loc.to(device=self.device, dtype=torch.int64)
        k = k.to(device=self.device).reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.to(device=self.device).reshape(-1, self.num_kv_heads, self.head_dim)
        scales = self.get_kv_scale_buffer(layer_id)
        if scales is None:
            index_copy_rows_(self.k_buffer[layer_id], 0, loc, to_storage(k, self.dtype))
            index_copy_rows_(self.v_buffer[layer_id], 0, loc, to_storage(v, self.dtype))
            return
        for buf, scale_buf, x in ((self.k_buffer, scales[0], k), (self.v_buffer, scales[1], v)):
            q, scale = quantize_int8(x)
            buf[layer_id].index_copy_(0, loc, q)
            scale_buf.index_copy_(0, loc, scale)

    def kv_buffers_of(self, layer_id: int) -> list[torch.Tensor]:
        """Every buffer a slot's KV lives in for this layer (K, V, and an int8 pool's scales), for
        code that moves whole slots (speculative tree compaction)."""
        return [*self.get_kv_buffer(layer_id), *(self.get_kv_scale_buffer(layer_id) or ())]
