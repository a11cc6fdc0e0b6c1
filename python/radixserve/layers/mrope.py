"""Multimodal rotary embedding (M-RoPE, Qwen2-VL family): the rotary pairs of a head are split
into three sections that rotate by the token's time, height and width positions.

Qwen2-VL / Qwen2.5-VL give each axis a contiguous run of pairs (mrope_section [t, h, w]: the first t
pairs time, the next h height, the next w width). Qwen3-VL interleaves them (`mrope_interleaved`):
pair j rotates by height when j % 3 == 1 and j < 3 * h, by width when j % 3 == 2 and j < 3 * w, and
by time otherwise, so every axis spans low and high frequencies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.layers.rotary import RotaryEmbedding, _rotate


class MRotaryEmbedding(RotaryEmbedding):
    """positions [3, num_tokens] (time, height, width), or [num_tokens] when the three are equal
    (text only), which is plain RoPE: the parent's path, fused kernel included."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        mrope_section: Sequence[int],
        interleaved: bool = False,
    ) -> None:
        super().__init__(head_dim, max_position, base)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must add up to head_dim / 2 = {head_dim // 2}"
            )
        # For each rotary pair, the axis whose position rotates it.
        axis = _interleaved_axes(mrope_section) if interleaved else _sectioned_axes(mrope_section)
        self.register_buffer("pair_axis", axis, persistent=False)  # [head_dim / 2]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        # Each pair j takes cos/sin at the position of its axis: gather [3, T, half] -> [T, half].
        idx = self.pair_axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos_cached[positions].gather(0, idx)[0].unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin_cached[positions].gather(0, idx)[0].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _sectioned_axes(mrope_section: Sequence[int]) -> torch.Tensor:
    """[sum(section)] axis of each pair: section[0] time pairs, then height, then width."""
    return torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(mrope_section)])


def _interleaved_axes(mrope_section: Sequence[int]) -> torch.Tensor:
    """[sum(section)] axis of each pair, interleaved t, h, w, t, h, w, ... while each axis has pairs
    left (transformers' Qwen3-VL: height takes pairs 1, 4, .. below 3 * section[1], width 2, 5, ..
    below 3 * section[2], time the rest)."""
    axis = torch.zeros(sum(mrope_section), dtype=torch.int64)
    for a in (1, 2):
        axis[a : 3 * mrope_section[a] : 3] = a
    return axis
