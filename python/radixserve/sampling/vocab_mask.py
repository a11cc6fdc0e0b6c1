"""The grammar's per-step token mask, held for the constrained rows of a batch only.

A batch mixing constrained and free requests used to carry a dense bool [bs, vocab] mask: every
free row was unpacked, inverted and masked_fill'ed as all-True. Keeping only the constrained rows
makes a free row cost nothing, whatever the batch holds beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class VocabMask:
    rows: Tensor  # [k] int64, the batch rows that are constrained (ascending)
    allowed: Tensor  # [k, vocab] bool, True = allowed

    def apply_(self, logits: Tensor) -> None:
        """Set disallowed tokens of the constrained rows to -inf, in place on logits [bs, vocab]."""
        rows = self.rows.to(logits.device)
        sub = logits.index_select(0, rows)  # [k, vocab]
        sub.masked_fill_(~self.allowed.to(logits.device), float("-inf"))
        logits.index_copy_(0, rows, sub)

    def filter(self, keep: Tensor, old_batch_size: int) -> VocabMask | None:
        """The mask after the batch keeps rows `keep` [n] (in that order); None if none stay."""
        new_row = torch.full((old_batch_size,), -1, dtype=torch.int64, device=keep.device)
        new_row[keep] = torch.arange(keep.numel(), device=keep.device)
        mapped = new_row[self.rows.to(keep.device)]  # [k], -1 = dropped
        stay = mapped >= 0
        if not bool(stay.any()):
            return None
        order = torch.argsort(mapped[stay])  # keep rows ascending in the new batch
        return VocabMask(mapped[stay][order], self.allowed[stay.to(self.allowed.device)][order])

    @staticmethod
    def merge(a: VocabMask | None, b: VocabMask | None, batch_size_a: int) -> VocabMask | None:
        """The mask of batch a followed by batch b (b's rows shift by batch_size_a)."""
        if a is None or b is None:
            if b is not None:
                return VocabMask(b.rows + batch_size_a, b.allowed)
            return a
        return VocabMask(torch.cat([a.rows, b.rows + batch_size_a]), torch.cat([a.allowed, b.allowed]))
