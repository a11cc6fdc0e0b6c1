"""The scheduler-side request the prefix-cache tests drive the caches with (test_radix_cache.py,
test_hiradix_cache.py): the fields `cache_*_req` read and write (mem_cache.base_cache.ReqLike)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    kv_committed_len: int = 0
    lora_id: str | None = None

    @property
    def cache_namespace(self) -> str | None:  # the scheduler's Req: its adapter's namespace
        return self.lora_id
