"""A request's images on the scheduler side (seed 002 §5.1.2, INVENTORY §31).

`MultimodalInputs` sits on the Req. Its prompt's image tokens are replaced by the image's pad
value (pad_values.py), so the radix cache shares a prefix past an image only with a request that
has the same image there; the model reads the image's embedding at those rows instead.

The vision encoder runs inside the forward (the model owns it) in the prefill that first reaches
an image's tokens; its output stays on the item for the later chunks of a chunked prefill and is
dropped by `maybe_clear_mm_inputs` once the last chunk that needs it ran. The pixels stay until
the request ends: a retracted request computes its prompt again, and encodes its images again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.managers.io_struct import MultimodalPayload
from radixserve.multimodal.pad_values import pad_value_of

if TYPE_CHECKING:
    from radixserve.scheduler.req import Req


@dataclass
class MultimodalDataItem:
    """One image of a request. `embedding` is written by the model's encoder (forward thread) and
    cleared by the scheduler; each side reads it once per use, so a clear racing a forward that no
    longer needs it is harmless."""

    pixel_values: torch.Tensor  # [num_patches, patch_dim] fp32
    grid_thw: tuple[int, int, int]
    offset: int  # first image token's index in the prompt
    num_tokens: int
    pad_value: int
    image_hash: int  # 64 bits of the processed pixels' sha256: the embedding cache's key
    embedding: torch.Tensor | None = None  # [num_tokens, hidden_size] on the model's device

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass
class MultimodalInputs:
    mm_items: list[MultimodalDataItem]
    mrope_positions: torch.Tensor  # [3, prompt_len] int64
    mrope_position_delta: int

    @classmethod
    def from_payload(cls, payload: MultimodalPayload) -> MultimodalInputs:
        items = [
            MultimodalDataItem(
                i.pixel_values, i.grid_thw, i.offset, i.num_tokens, pad_value_of(i.hash), i.hash
            )
            for i in payload.items
        ]
        return cls(items, payload.mrope_positions, payload.mrope_position_delta)

    def pad_input_ids(self, ids: list[int]) -> list[int]:
        """`ids` with every image's tokens replaced by its pad value."""
        out = list(ids)
        for item in self.mm_items:
            out[item.offset : item.end] = [item.pad_value] * item.num_tokens
        return out

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] M-RoPE positions of sequence positions start..end-1: the prompt's own,
        then (generated tokens) the index plus the delta on all three axes."""
        prompt_len = self.mrope_positions.shape[1]
        parts = []
        if start < prompt_len:
            parts.append(self.mrope_positions[:, start : min(end, prompt_len)])
        if end > prompt_len:
            tail = torch.arange(max(start, prompt_len), end, dtype=torch.int64) + self.mrope_position_delta
            parts.append(tail.expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def attach_mm_inputs(req: Req, payload: MultimodalPayload) -> None:
    """Seed 002 §5.1.2: the request's MultimodalInputs, and its prompt padded with pad values."""
    mm = MultimodalInputs.from_payload(payload)
    req.multimodal_inputs = mm
    req.origin_input_ids = mm.pad_input_ids(req.origin_input_ids)


@dataclass(frozen=True)
class ImageSlice:
    """Rows of a forward that read an image's embedding: batch rows row_start.. get the item's
    embedding rows token_start..token_end-1."""

    item: MultimodalDataItem
    row_start: int
    token_start: int
    token_end: int


@dataclass(frozen=True)
class MultimodalForward:
    """What a prefill forward needs of its requests' images (ModelWorkerBatch.multimodal)."""

    slices: tuple[ImageSlice, ...]


def image_slices(
    reqs: Sequence[Req], prefix_lens: Sequence[int], seq_lens: Sequence[int]
) -> MultimodalForward | None:
    """The image rows of an extend batch whose request i computes positions prefix_lens[i]..
    seq_lens[i]-1 (rows laid out request after request); None when it has none."""
    slices: list[ImageSlice] = []
    row = 0
    for r, p, s in zip(reqs, prefix_lens, seq_lens):
        mm = r.multimodal_inputs
        if mm is not None:
            for item in mm.mm_items:
                lo, hi = max(p, item.offset), min(s, item.end)
                if lo < hi:
                    slices.append(ImageSlice(item, row + lo - p, lo - item.offset, hi - item.offset))
        row += s - p
    return MultimodalForward(tuple(slices)) if slices else None


def mrope_batch_positions(
    reqs: Sequence[Req], prefix_lens: Sequence[int], extend_lens: Sequence[int]
) -> torch.Tensor | None:
    """[3, num_tokens] M-RoPE positions of a batch with an image request in it, else None (the
    model then uses the 1-D positions on all three axes, which is what text alone has)."""
    if all(r.multimodal_inputs is None for r in reqs):
        return None
    parts = []
    for r, p, e in zip(reqs, prefix_lens, extend_lens):
        mm = r.multimodal_inputs
        if mm is not None:
            parts.append(mm.positions(p, p + e))
        else:
            parts.append(torch.arange(p, p + e, dtype=torch.int64).expand(3, -1))
    return torch.cat(parts, dim=1)


def maybe_clear_mm_inputs(reqs: Sequence[Req], seq_lens: Sequence[int]) -> None:
    """After a prefill's results: drop the encoder output of every image whose tokens are all
    computed (a later chunk of the same prompt starts past it)."""
    for r, s in zip(reqs, seq_lens):
        mm = r.multimodal_inputs
        if mm is None:
            continue
        for item in mm.mm_items:
            if item.embedding is not None and item.end <= s:
                item.embedding = None
