"""The scheduler side of a verify step: KV slots for [x0, drafts] per request, and giving back the
slots of rejected drafts once the result is known (page_size 1 or more).

KV invariant kept: positions < req.kv_committed_len hold KV of the request's accepted tokens only;
the radix cache is only ever handed positions below it, so it never sees a rejected draft.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from radixserve.model_executor.forward_batch import ForwardMode
from radixserve.speculative.tree import DraftTree, as_tree

if TYPE_CHECKING:
    from radixserve.scheduler.kv_memory import KVMemory
    from radixserve.scheduler.req import Req
    from radixserve.scheduler.schedule_batch import ScheduleBatch


def verify_tokens_needed(mem: KVMemory, committed: list[int], num_drafts: list[int]) -> int:
    """KV slots a verify step takes: positions committed .. committed + k per request, in pages."""
    ps = mem.page_size
    if ps == 1:
        return sum(1 + k for k in num_drafts)
    # Pages that start at or after the first new position (the page holding it may be partly free).
    total = 0
    for c, k in zip(committed, num_drafts):
        first_new_page = -(-c // ps)  # pages fully below c are already the request's
        last_page = (c + k) // ps
        total += max(last_page - first_new_page + 1, 0) * ps
    return total


def prepare_for_verify(batch: ScheduleBatch, drafts: list[list[int]] | list[list[int] | DraftTree]) -> None:
    """Lay out a TARGET_VERIFY step: request b computes [newest token, drafts_b] in the KV slots
    of positions kv_committed_len .. kv_committed_len + k_b, over its cached KV (like an extend).
    A draft tree's rows take those slots in row order (the worker moves the accepted path's KV to
    consecutive positions after the forward)."""
    trees = [as_tree(d) for d in drafts]
    drafts = [t.tokens for t in trees]
    batch.spec_tree_parents = None if all(t.is_chain() for t in trees) else [t.row_parents() for t in trees]
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    reqs = batch.reqs
    mem = batch.mem
    batch.prefix_lens = [r.kv_committed_len for r in reqs]
    batch.extend_lens = [1 + len(d) for d in drafts]
    batch.seq_lens = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)]
    batch.extend_num_tokens = sum(batch.extend_lens)
    batch.extend_logprob_start_lens = None
    batch.input_ids = torch.tensor(
        list(itertools.chain.from_iterable([r.output_ids[-1], *d] for r, d in zip(reqs, drafts))),
        dtype=torch.int64,
    )
    table = mem.req_to_token_pool.req_to_token
    rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)  # [bs]
    prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)  # [bs]
    ext = torch.tensor(batch.extend_lens, dtype=torch.int64)  # [bs]
    last_loc = table[rows, prefix - 1].tolist()
    batch.out_cache_loc = mem.alloc_extend(
        batch.prefix_lens, batch.seq_lens, last_loc, batch.extend_num_tokens
    )
    # req_to_token[row_b, p_b .. p_b + e_b - 1] = request b's new slots: one scatter for the batch.
    token_rows = torch.repeat_interleave(rows, ext)  # [num_tokens]
    cols = torch.arange(batch.extend_num_tokens, dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(ext, 0) - ext - prefix, ext
    )
    table[token_rows.to(table.device), cols.to(table.device)] = batch.out_cache_loc.to(
        table.device, table.dtype
    )
    for r, s in zip(reqs, batch.seq_lens):
        r.kv_committed_len = s  # being written by the launched forward
    batch.spec_drafts = drafts


def release_rejected(mem: KVMemory, req: Req, keep_len: int, end_len: int) -> None:
    """Positions keep_len .. end_len - 1 of `req` were computed but not accepted: give back every
    page that holds only such positions (the page holding position keep_len - 1 stays: the
    request keeps filling it) and commit keep_len."""
    req.kv_committed_len = keep_len
    start = mem.ceil_paged(keep_len)
    if start < end_len:
        mem.allocator.free(mem.row_slots(req, start, end_len))
