"""The batched LoRA delta: out[t] += (x[t] @ A[s_t]^T) @ B[s_t]^T for every token row t whose
adapter slot s_t >= 0 (rows of the base model, slot -1, get nothing).

Two implementations of the same contract:

- `lora_delta_reference`: torch-native, one gathered batched matmul over every adapted row
  (BGMV-style: each row reads its own slot's matrices). Simple and obviously right; its gather
  copies rank x in_features values per row, so it is the reference, not the fast path.
- `lora_delta_segmented`: SGMV-style. `LoRASegments` (built once per forward, shared by every
  layer) groups the rows by slot; each group is two dense GEMMs on its slot's matrices, at most
  --max-loras-per-batch groups per projection, never a loop over requests. A group whose rows are
  contiguous (a prefill's tokens) is a slice, not a gather.

B holds the adapter's scaling already (lora/adapter.py), and a slot's rank is padded with zeros
to the pool's rank, which adds exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRASegment:
    slot: int
    rows: torch.Tensor | slice  # the token rows of this slot: a slice when contiguous


@dataclass(frozen=True)
class LoRASegments:
    """A forward's token rows grouped by adapter slot (base rows in no group)."""

    token_slots: torch.Tensor  # [num_tokens] int64, -1 = base
    segments: tuple[LoRASegment, ...]

    @classmethod
    def build(cls, token_slots: torch.Tensor) -> LoRASegments:
        segments = []
        for slot in torch.unique(token_slots).tolist():
            if slot < 0:
                continue
            rows = (token_slots == slot).nonzero().flatten()  # [rows of slot]
            first, last = int(rows[0]), int(rows[-1])
            contiguous = last - first + 1 == rows.numel()
            segments.append(LoRASegment(slot, slice(first, last + 1) if contiguous else rows))
        return cls(token_slots, tuple(segments))


def lora_delta_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """x [n, in], a [slots, rank, in], b [slots, out, rank], token_slots [n]; adds into out [n, out]."""
    rows = (token_slots >= 0).nonzero().flatten()  # [m]
    if rows.numel() == 0:
        return
    slots = token_slots[rows]
    xa = torch.bmm(a[slots], x[rows].unsqueeze(-1))  # [m, rank, 1]
    delta = torch.bmm(b[slots], xa).squeeze(-1)  # [m, out]
    out.index_add_(0, rows, delta.to(out.dtype))


def lora_delta_segmented(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoRASegments, out: torch.Tensor
) -> None:
    """The same as lora_delta_reference, one pair of GEMMs per slot present in the batch."""
    for seg in segments.segments:
        if isinstance(seg.rows, slice):
            xs = x[seg.rows]  # [rows, in] (a view)
            out[seg.rows] += (xs @ a[seg.slot].t()) @ b[seg.slot].t()
        else:
            delta = (x[seg.rows] @ a[seg.slot].t()) @ b[seg.slot].t()  # [rows, out]
            out.index_add_(0, seg.rows, delta)
