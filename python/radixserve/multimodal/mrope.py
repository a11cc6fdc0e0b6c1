"""M-RoPE positions of a prompt with images (Qwen2-VL family): three axes (time, height, width).

Text tokens advance all three axes together. An image of llm_h x llm_w merged patches starting at
position p gets (p, p + row, p + col); the text after it continues from p + max(llm_h, llm_w), one
past the image's largest position. Past the prompt every token's position is its index plus the
prompt's delta (max position + 1 - prompt length), on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def image_positions(start: int, grid_thw: Sequence[int], merge: int) -> torch.Tensor:
    """[3, t * llm_h * llm_w] positions of one image's tokens (row-major over the merged grid)."""
    t, h, w = (int(x) for x in grid_thw)
    llm_h, llm_w = h // merge, w // merge
    tt, hh, ww = torch.meshgrid(
        torch.arange(t), torch.arange(llm_h), torch.arange(llm_w), indexing="ij"
    )  # each [t, llm_h, llm_w]
    return torch.stack([tt, hh, ww]).reshape(3, -1).to(torch.int64) + start


def prompt_mrope_positions(
    prompt_len: int, images: Sequence[tuple[int, int, Sequence[int]]], merge: int
) -> tuple[torch.Tensor, int]:
    """([3, prompt_len] int64 positions, delta) for a prompt whose images are (offset, num_tokens,
    grid_thw), in prompt order."""
    parts: list[torch.Tensor] = []
    cursor = pos = 0  # next prompt index, next position
    for offset, num_tokens, grid in images:
        if offset > cursor:
            parts.append(torch.arange(pos, pos + offset - cursor, dtype=torch.int64).expand(3, -1))
            pos += offset - cursor
        img = image_positions(pos, grid, merge)
        assert img.shape[1] == num_tokens, "the image's token count disagrees with its grid"
        parts.append(img)
        pos = int(img.max()) + 1
        cursor = offset + num_tokens
    if prompt_len > cursor:
        parts.append(torch.arange(pos, pos + prompt_len - cursor, dtype=torch.int64).expand(3, -1))
    positions = torch.cat(parts, dim=1)  # [3, prompt_len]
    return positions.contiguous(), int(positions.max()) + 1 - prompt_len
