"""The two lower levels of KV memory (seed 004).

- ``ReqToTokenPool`` (addressing): one row per running request, column = token position,
  value = KV slot. Attention reads ``req_to_token[req_pool_idx, :seq_len]`` to gather a request's
  KV from anywhere in the pool, so slots need not be contiguous.
- ``MHATokenToKVPool`` (physical): per-layer K and V buffers indexed by slot.
"""

from __future__ import annotations

import torch

from radixserve.mem_cache import cpu_alloc


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
        self.clear()

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
    """Per-layer K/V buffers ``[size + page_size, num_kv_heads, head_dim]``.

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

    @staticmethod
    def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V that one token occupies across all layers (for sizing from a budget)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K bytes, V bytes) actually allocated, padding page included."""
        k = sum(t.numel() * t.element_size() for t in self.k_buffer)
        v = sum(t.numel() * t.element_size() for t in self.v_buffer)
        return k, v

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v ([N, num_kv_heads, head_dim]) into slots ``loc`` ([N] int64), casting to the pool dtype."""
        loc = loc.to(device=self.device, dtype=torch.int64)
        k = k.to(device=self.device, dtype=self.dtype).reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.to(device=self.device, dtype=self.dtype).reshape(-1, self.num_kv_heads, self.head_dim)
        self.k_buffer[layer_id].index_copy_(0, loc, k)
        self.v_buffer[layer_id].index_copy_(0, loc, v)
