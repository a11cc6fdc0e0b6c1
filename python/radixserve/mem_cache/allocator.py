"""Paged slot allocator for the token-to-KV pool.

The KV pool is addressed by *slot* (one token's K/V row). Slots are grouped into pages of
``page_size`` consecutive slots; page ``p`` owns slots ``p * page_size .. (p + 1) * page_size - 1``.
Page 0 is reserved as padding (a safe dummy write target for attention kernels), so the usable
pages are ``1 .. num_pages``.

The allocator hands out whole pages and tracks which pages are free. Every slot tensor it returns
is a CPU ``int64`` tensor: slot bookkeeping is scheduler-side data, and the model runner copies
``out_cache_loc`` to the device with the rest of the batch.

The page-level state (the free list, the free flags) is numpy: a decode step takes a page or a
few every step, right after the forward has streamed the weights through the caches, where a small
torch op costs several times a numpy one (benchmark/bench_cold_ops.py; docs/cpu_backend.md, "Host
work around a step"). The slot tensors handed out share nothing with that state.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenToKVPoolAllocator:
    """Hands out and takes back pages of KV slots; ``page_size >= 1``."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size <= 0 or size % page_size != 0:
            raise ValueError(f"size ({size}) must be a positive multiple of page_size ({page_size})")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        """Mark every usable page free (page 0 stays reserved)."""
        # Pages are taken from `_free_pages[_head:]`; freed pages wait in `_released` and are
        # merged lazily, so a free is O(1) Python work and a merge costs one concatenate.
        self._free_pages = np.arange(1, self.num_pages + 1, dtype=np.int64)  # [num_free + _head]
        self._head = 0
        self._released: list[np.ndarray] = []
        self._num_free = self.num_pages
        # Page-level free flags, only for catching double frees and foreign slots.
        self._page_is_free = np.ones(self.num_pages + 1, dtype=np.bool_)  # [num_pages + 1]
        self._page_is_free[0] = False

    def available_size(self) -> int:
        """Free tokens: free pages * page_size."""
        return self._num_free * self.page_size

    # ------------------------------------------------------------------ page level

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        """Pop ``num_pages`` free page ids (a new [num_pages] int64 tensor), or None without side
        effects."""
        pages = self._take_page_ids(num_pages)
        return None if pages is None else torch.from_numpy(pages)

    def _take_page_ids(self, num_pages: int) -> np.ndarray | None:
        """_take_pages as a new numpy array (the caller owns it)."""
        if num_pages > self._num_free:
            return None
        head = self._head
        if head + num_pages > len(self._free_pages):
            self._free_pages = np.concatenate([self._free_pages[head:], *self._released])
            self._released.clear()
            head = 0
        pages = self._free_pages[head : head + num_pages].copy()
        self._head = head + num_pages
        self._page_is_free[pages] = False
        self._num_free -= num_pages
        return pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """[P] page ids -> [P * page_size] slots, page by page."""
        if self.page_size == 1:
            return pages  # _take_pages' tensor is the caller's own
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    # ------------------------------------------------------------------ alloc

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` fresh slots ([need_size] int64) made of whole pages, or None.

        With page_size > 1 ``need_size`` must be a multiple of page_size (use alloc_extend for
        sequences that continue a partly filled page).
        """
        if need_size % self.page_size != 0:
            raise ValueError(f"alloc({need_size}) is not a multiple of page_size {self.page_size}")
        pages = self._take_pages(need_size // self.page_size)
        return None if pages is None else self._pages_to_slots(pages)

    def alloc_extend(
        self,
        prefix_lens: list[int],
        seq_lens: list[int],
        last_loc: list[int],
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for positions prefix_len..seq_len-1 of each request, concatenated in order.

        A request whose prefix ends mid-page first fills the rest of that page (the page that holds
        ``last_loc``, the slot of position prefix_len-1), then takes whole new pages. Returns
        [extend_num_tokens] int64, or None (nothing allocated) when pages run out.
        """
        ps = self.page_size
        prefix = torch.tensor(prefix_lens, dtype=torch.int64)  # [bs]
        seq = torch.tensor(seq_lens, dtype=torch.int64)  # [bs]
        ext = seq - prefix  # [bs]
        if prefix.numel() != seq.numel() or len(last_loc) != prefix.numel():
            raise ValueError("prefix_lens, seq_lens and last_loc must have the same length")
        if bool((ext < 0).any()) or int(ext.sum()) != extend_num_tokens:
            raise ValueError(
                f"extend_num_tokens={extend_num_tokens} does not match seq_lens - prefix_lens "
                f"(sum {int(ext.sum())}) or some seq_len < prefix_len"
            )
        if ps == 1:
            # Every token is its own page: no partial pages to fill.
            return self._take_pages(extend_num_tokens)

        # Room left in the page holding position prefix_len-1 (0 when prefix_len is page-aligned).
        room = (ps - prefix % ps) % ps  # [bs]
        fill = torch.minimum(room, ext)  # [bs] tokens placed in the partly filled page
        new_tok = ext - fill  # [bs] tokens needing fresh pages
        new_pages = (new_tok + ps - 1) // ps  # [bs]
        pages = self._take_pages(int(new_pages.sum()))
        if pages is None:
            return None
        loc = torch.tensor(last_loc, dtype=torch.int64)  # [bs]
        self._check_fill_pages(loc, prefix, fill)
        return self._scatter_extend(loc, fill, new_tok, new_pages, pages, extend_num_tokens)

    def _check_fill_pages(self, loc: torch.Tensor, prefix: torch.Tensor, fill: torch.Tensor) -> None:
        """A mid-page prefix must end at the matching offset of a page this allocator handed out."""
        ps = self.page_size
        filling = fill > 0
        if not bool(filling.any()):
            return
        loc_f, prefix_f = loc[filling], prefix[filling]
        bad_offset = (loc_f % ps) != ((prefix_f - 1) % ps)
        pages_f = loc_f // ps
        bad_page = (pages_f < 1) | (pages_f > self.num_pages)
        if bool((bad_offset | bad_page).any()):
            raise ValueError(f"last_loc {loc_f.tolist()} inconsistent with prefix_lens {prefix_f.tolist()}")
        if bool(self._page_is_free[pages_f.numpy()].any()):
            raise RuntimeError("alloc_extend: last_loc lies in a page that is free (use after free)")

    def _scatter_extend(
        self,
        loc: torch.Tensor,
        fill: torch.Tensor,
        new_tok: torch.Tensor,
        new_pages: torch.Tensor,
        pages: torch.Tensor,
        total: int,
    ) -> torch.Tensor:
        """Lay out per-request [fill slots, new-page slots] into one [total] tensor, vectorized."""
        ps = self.page_size
        bs = loc.numel()
        req_ids = torch.arange(bs, dtype=torch.int64)
        out_start = torch.cumsum(fill + new_tok, 0) - (fill + new_tok)  # [bs]
        out = torch.empty(total, dtype=torch.int64)

        # Fill part: slots last_loc+1, last_loc+2, ... inside the current page.
        num_fill = int(fill.sum())
        if num_fill:
            owner = torch.repeat_interleave(req_ids, fill)  # [num_fill]
            rank = torch.arange(num_fill) - (torch.cumsum(fill, 0) - fill)[owner]
            out[out_start[owner] + rank] = loc[owner] + 1 + rank

        # New-page part: each request's pages are a contiguous run of `pages`; keep only the
        # first new_tok slots of that run (the last page may be partly used).
        if pages.numel():
            page_owner = torch.repeat_interleave(req_ids, new_pages)  # [P]
            page_rank = torch.arange(pages.numel()) - (torch.cumsum(new_pages, 0) - new_pages)[page_owner]
            offs = page_rank[:, None] * ps + torch.arange(ps)  # [P, ps] offset within request's new run
            slots = pages[:, None] * ps + torch.arange(ps)  # [P, ps]
            owner = page_owner[:, None].expand(-1, ps)  # [P, ps]
            keep = offs < new_tok[owner]
            owner, offs, slots = owner[keep], offs[keep], slots[keep]
            out[out_start[owner] + fill[owner] + offs] = slots
        return out

    def alloc_decode(self, seq_lens: list[int], last_loc: list[int]) -> torch.Tensor | None:
        """One slot per request for position seq_len-1 ([bs] int64), or None (nothing allocated).

        ``seq_lens`` already count the new token; a new page is taken only when that position
        starts a page, otherwise the slot after ``last_loc`` is used.
        """
        if self.page_size == 1:
            return self._take_pages(len(seq_lens))
        # Python lists: a decode step's few rows cost less than the torch ops would (module doc).
        ps = self.page_size
        starts = [i for i, s in enumerate(seq_lens) if (s - 1) % ps == 0]  # rows whose token opens a page
        pages = self._take_page_ids(len(starts))
        if pages is None:
            return None
        out = [loc + 1 for loc in last_loc]
        for i, page in zip(starts, pages.tolist()):
            out[i] = page * ps
        return torch.tensor(out, dtype=torch.int64)  # [bs]

    # ------------------------------------------------------------------ free

    def free(self, free_index: torch.Tensor) -> None:
        """Free every page touched by these slots. Freeing a page that is already free raises."""
        if free_index.numel() == 0:
            return
        slots = free_index.reshape(-1).to(device="cpu", dtype=torch.int64).numpy()
        # A copy either way: the caller may reuse its tensor, and `_released` keeps this one until
        # the next merge.
        pages = np.unique(slots // self.page_size) if self.page_size > 1 else slots.copy()
        if self.page_size == 1 and len(np.unique(pages)) != len(pages):
            raise RuntimeError("double free: the same KV slot appears twice in one free() call")
        if bool(((pages < 1) | (pages > self.num_pages)).any()):
            raise ValueError(f"free() got slots outside the usable pool: {slots.tolist()[:16]}")
        already = self._page_is_free[pages]
        if bool(already.any()):
            dup = pages[already][:8].tolist()
            raise RuntimeError(f"double free of KV page(s) {dup} (page_size={self.page_size})")
        self._page_is_free[pages] = True
        self._released.append(pages)
        self._num_free += len(pages)

    def is_free_mask(self, slots: torch.Tensor) -> torch.Tensor:
        """Debug helper: [N] bool, whether the page holding each slot is free (page 0 never is)."""
        pages = slots.to(device="cpu", dtype=torch.int64).numpy() // self.page_size
        return torch.from_numpy(self._page_is_free[pages])
