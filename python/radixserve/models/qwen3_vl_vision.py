"""Qwen3-VL's vision tower: patch embedding (with bias) plus learned position embeddings resampled
to the image's grid, LayerNorm blocks with full attention over each frame and 2-D rotary positions,
the patch merger, and deepstack: mergers over the outputs of the blocks the config lists
(deepstack_visual_indexes), whose features the language model adds to its first layers' states.

It encodes one image at a time and returns one tensor per image, [num_tokens, (1 + num_deepstack) *
out_hidden_size]: the merger's output, then each deepstack feature. Kept as one tensor, the
embedding cache and the chunk slicing (multimodal/inputs.py) carry the deepstack features with the
main embedding without knowing about them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.linear import Linear
from radixserve.model_loader.errors import ModelLoadError
from radixserve.models.qwen2_5_vl_vision import (
    VisionBlock,
    rotary_freqs,
    segment_mask,
    vision_activation,
)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = vision_activation(act)
        self.linear_fc1 = Linear(dim, hidden, bias=True)
        self.linear_fc2 = Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """LayerNorm, each 2x2 group of patches concatenated, a 2-layer GELU MLP to the LM width. The
    main merger normalises each patch before grouping; the deepstack mergers normalise the group
    (post-shuffle)."""

    def __init__(self, out_dim: int, dim: int, merge: int, postshuffle_norm: bool) -> None:
        super().__init__()
        self.group_dim = dim * merge * merge
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.group_dim if postshuffle_norm else dim, eps=1e-6)
        self.linear_fc1 = Linear(self.group_dim, self.group_dim, bias=True)
        self.linear_fc2 = Linear(self.group_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[num_patches, dim] -> [num_patches / merge^2, out_dim]."""
        x = (
            self.norm(x.view(-1, self.group_dim))
            if self.postshuffle_norm
            else self.norm(x).view(-1, self.group_dim)
        )
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, cfg: Any) -> None:  # noqa: ANN401 - an HF vision config
        super().__init__()
        self.merge = cfg.spatial_merge_size
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size * cfg.patch_size
        # The checkpoint's Conv3d with kernel == stride over one patch is this linear map of the
        # flattened patch (channel, time, row, column order, as the processor flattens it).
        self.patch_embed = Linear(patch_dim, cfg.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.grid_side = int(cfg.num_position_embeddings**0.5)  # the learned grid is square
        head_dim = cfg.hidden_size // cfg.num_heads
        theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / (theta**quarter), persistent=False)  # [head_dim / 4]
        self.blocks = nn.ModuleList(VisionBlock(cfg, nn.LayerNorm, VisionMLP) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.hidden_size, self.merge, postshuffle_norm=False)
        self.deepstack_indexes = [int(i) for i in cfg.deepstack_visual_indexes]
        if any(not 0 <= i < cfg.depth for i in self.deepstack_indexes):
            raise ModelLoadError(
                f"deepstack_visual_indexes {self.deepstack_indexes} must name blocks of a {cfg.depth}-block tower"
            )
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg.out_hidden_size, cfg.hidden_size, self.merge, postshuffle_norm=True)
            for _ in self.deepstack_indexes
        )
        # Columns of an image's output, the deepstack features included (models/vit_dp.py).
        self.output_width = (1 + len(self.deepstack_indexes)) * cfg.out_hidden_size

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, patch_dim] -> [t*h*w / 4, (1 + num_deepstack) * out_hidden]."""
        t, h, w = grid_thw
        device = self.inv_freq.device
        x = self.patch_embed(pixel_values.to(device, self.patch_embed.weight.dtype))  # [N, hidden]
        x = x + self._position_embeds(t, h, w).to(x.dtype)
        freqs = rotary_freqs(t, h, w, self.merge, self.inv_freq)  # [N, head_dim / 2]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        # Full attention within each frame (an image is one frame: no mask at all).
        mask = segment_mask(torch.arange(t + 1, dtype=torch.int64) * (h * w), device) if t > 1 else None
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _position_embeds(self, t: int, h: int, w: int) -> torch.Tensor:
        """[t*h*w, hidden]: the learned square grid resampled to h x w (bilinear, corners aligned,
        transformers' Qwen3-VL), patches listed merged unit by merged unit, repeated per frame."""
        side, m = self.grid_side, self.merge
        grid = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()
        resampled = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
        units = resampled.view(-1, h // m, m, w // m, m).permute(1, 3, 2, 4, 0)  # [h/m, w/m, m, m, hidden]
        return units.reshape(h * w, -1).repeat(t, 1)
