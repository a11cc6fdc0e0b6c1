"""PrefillAdder: decides which waiting requests fit in the next prefill batch (seed 001 §4.1,
seed 000 §5), against three budgets:

- rem_total_tokens: free + evictable KV minus what running requests are expected to still need
  (new_token_ratio x their remaining max_new_tokens, each clipped to CLIP_MAX_NEW_TOKENS);
- rem_input_tokens: new prompt tokens per batch (max_prefill_tokens);
- rem_chunk_tokens: tokens per chunk (chunked_prefill_size; None when chunking is off).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch

from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.req import Req

# Caps each request's reserved output in admission so a huge max_new_tokens does not make the
# scheduler over-conservative (seed 001).
CLIP_MAX_NEW_TOKENS = 4096


class AddReqResult(Enum):
    CONTINUE = auto()  # more requests may still fit
    NO_TOKEN = auto()  # the KV budget is exhausted
    OTHER = auto()  # another budget (input tokens, chunk, batch size) is exhausted


def remaining_new_tokens(req: Req) -> int:
    """The request's still-possible output, clipped for admission accounting."""
    return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)


class PrefillAdder:
    def __init__(
        self,
        mem: KVMemory,
        running_reqs: list[Req],
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        mixed_with_decode_tokens: int = 0,
        mixed_with_decode_kv: int = 0,
    ) -> None:
        """`mixed_with_decode_tokens`: running requests decoding in the same forward (mixed chunk),
        one input token each; `mixed_with_decode_kv`: the KV slots those decodes take (a whole page
        for each that starts one)."""
        self.mem = mem
        self.tree_cache = mem.tree_cache
        self.page_size = mem.page_size
        self.new_token_ratio = new_token_ratio
        # In a mixed batch every running request also runs one decode token in the same forward.
        self.rem_input_tokens = rem_input_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = rem_chunk_tokens
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= mixed_with_decode_tokens
        # Offsets subtracted from free + evictable KV: the total one also reserves future output.
        self.rem_total_token_offset = mixed_with_decode_kv + sum(
            self.reserved_tokens(r) for r in running_reqs
        )
        self.cur_rem_token_offset = mixed_with_decode_kv
        self.can_run_list: list[Req] = []
        self.preempt_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.log_hit_tokens = 0
        self.log_input_tokens = 0

    def reserved_tokens(self, running_req: Req) -> float:
        return remaining_new_tokens(running_req) * self.new_token_ratio

    # ------------------------------------------------------------------ budgets
    @property
    def rem_total_tokens(self) -> float:
        return self.mem.available_size() + self.mem.evictable_size() - self.rem_total_token_offset

    @property
    def cur_rem_tokens(self) -> float:
        """What this batch's own prompts may still take right now (no output reservation)."""
        return self.mem.available_size() + self.mem.evictable_size() - self.cur_rem_token_offset

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _update_prefill_budget(self, prefix_len: int, extend_input_len: int, max_new_tokens: int) -> None:
        extend_input_len = self.mem.ceil_paged(extend_input_len)
        self.rem_total_token_offset += extend_input_len + max_new_tokens
        self.cur_rem_token_offset += extend_input_len
        self.rem_input_tokens -= extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_input_len
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_input_len

    @contextmanager
    def _lock_node(self, last_node: Any) -> Iterator[None]:  # noqa: ANN401 - a TreeNode or None
        """Protect the matched prefix from eviction while its cost is being accounted."""
        self.tree_cache.inc_lock_ref(last_node)
        try:
            yield
        finally:
            self.tree_cache.dec_lock_ref(last_node)

    # ------------------------------------------------------------------ adding
    def add_chunked_req(self, req: Req) -> Req | None:
        """Schedule the next chunk of the in-flight chunked request first; returns it while more
        chunks remain, None once this is its last chunk (it is in can_run_list iff scheduled)."""
        assert self.rem_chunk_tokens is not None, "a chunked request exists only with chunking on"
        # The chunk must also fit the KV that is free now (the running decodes may have taken
        # what was free when the request was admitted): a smaller chunk, or none this round.
        room = min(self.rem_chunk_tokens, int(self.cur_rem_tokens) // self.page_size * self.page_size)
        truncated = req.extend_input_len > room
        if truncated:
            trunc_len = room // self.page_size * self.page_size
            if trunc_len <= 0:
                return req  # no room for a page this round: wait
            req.set_extend_input_len(trunc_len)
        self.can_run_list.append(req)
        self._update_prefill_budget(0, req.extend_input_len, 0 if truncated else remaining_new_tokens(req))
        return req if truncated else None

    def _load_host_prefix(self, req: Req) -> None:
        """HiCache: bring the host-tier part of the request's match into the device pool, so it
        is a prefix like any other (if the pool cannot make room, those tokens are computed)."""
        loaded = self.tree_cache.load_back(req.last_node, req.last_host_node)
        req.host_hit_length, req.last_host_node = 0, None
        if loaded is not None:
            slots, req.last_node = loaded
            req.prefix_indices = torch.cat([req.prefix_indices, slots])
            req.extend_input_len -= slots.numel()

    def add_one_req(self, req: Req) -> AddReqResult:
        """Admit `req` whole, or its first chunk, if the budgets allow (seed 001 L389-416)."""
        if req.host_hit_length > 0:
            self._load_host_prefix(req)
        total_tokens = req.extend_input_len + remaining_new_tokens(req)
        input_tokens = self.mem.ceil_paged(req.extend_input_len)
        prefix_len = len(req.prefix_indices)
        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        # The first request may exceed rem_input_tokens: otherwise a long prompt would never run.
        if input_tokens >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        # Mean/CLS pooling needs the whole prompt in one forward: never chunked; alone in its
        # batch if it is longer than a chunk.
        whole = req.needs_all_tokens
        if whole and self.rem_chunk_tokens is not None and input_tokens > self.rem_chunk_tokens:
            if self.can_run_list:
                return AddReqResult.OTHER
        with self._lock_node(req.last_node):
            # Locking made the matched prefix unevictable, which can shrink the budget.
            if total_tokens >= self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens or whole:
                self.can_run_list.append(req)
                self.tree_cache.inc_lock_ref(req.last_node)
                self._update_prefill_budget(prefix_len, input_tokens, remaining_new_tokens(req))
            else:
                trunc_len = self.rem_chunk_tokens // self.page_size * self.page_size
                if trunc_len <= 0:
                    return AddReqResult.OTHER
                req.set_extend_input_len(trunc_len)
                self.can_run_list.append(req)
                self.new_chunked_req = req
                self.tree_cache.inc_lock_ref(req.last_node)
                self._update_prefill_budget(prefix_len, trunc_len, 0)
        return self.budget_state()

    def remove_from_budget(self, running_req: Req) -> None:
        """A running request was preempted: its reservation is no longer owed (its KV is freed)."""
        self.rem_total_token_offset -= self.reserved_tokens(running_req)
