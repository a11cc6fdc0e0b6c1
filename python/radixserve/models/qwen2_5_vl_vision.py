"""Qwen2.5-VL's vision tower: patch embedding, blocks with window or full attention, 2-D rotary
positions, and the patch merger that turns each 2x2 group of patches into one LM token.

It encodes one image at a time (the scheduler asks for each image once). Window attention works on
the merged-unit grid cut into windows of window_size pixels; the tokens are permuted so that each
window is contiguous, attended within, and permuted back after the merger.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.linear import Linear
from radixserve.layers.norm import RMSNorm
from radixserve.model_loader.errors import ModelLoadError

VISION_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def _rotate_half_float(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation in fp32; x [N, heads, head_dim], cos/sin [N, 1, head_dim / 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, heads, hd]
        q, k = _rotate_half_float(q, cos, sin), _rotate_half_float(k, cos, sin)
        # Bidirectional within a window / frame: mask [N, N] bool, True = attend (None: all).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )  # [heads, N, hd]
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = vision_activation(act)
        self.gate_proj = Linear(dim, hidden, bias=True)
        self.up_proj = Linear(dim, hidden, bias=True)
        self.down_proj = Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def vision_activation(act: str) -> Any:  # noqa: ANN401 - a torch activation
    if act not in VISION_ACTIVATIONS:
        raise ModelLoadError(
            f"Unsupported vision hidden_act {act!r} (supported: {', '.join(VISION_ACTIVATIONS)})"
        )
    return VISION_ACTIVATIONS[act]


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP; `norm` is RMSNorm (Qwen2.5-VL) or LayerNorm (Qwen3-VL), `mlp`
    the family's MLP class."""

    def __init__(self, cfg: Any, norm: type[nn.Module] = RMSNorm, mlp: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.norm1 = norm(cfg.hidden_size, eps=1e-6)
        self.norm2 = norm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = (mlp or VisionMLP)(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate each 2x2 group, then a 2-layer GELU MLP to the LM width."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.group_dim = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(
            Linear(self.group_dim, self.group_dim, bias=True),
            nn.GELU(),
            Linear(self.group_dim, out_dim, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group_dim))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.merge, self.patch_size, self.window_size = (
            cfg.spatial_merge_size,
            cfg.patch_size,
            cfg.window_size,
        )
        self.unit = self.merge * self.merge  # patches per merged token
        self.fullatt_blocks = set(cfg.fullatt_block_indexes)
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size * cfg.patch_size
        # The checkpoint's Conv3d with kernel == stride over one patch is this linear map of the
        # flattened patch (channel, time, row, column order, as the processor flattens it).
        self.patch_embed = Linear(patch_dim, cfg.hidden_size, bias=False)
        head_dim = cfg.hidden_size // cfg.num_heads
        theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / (theta**quarter), persistent=False)  # [head_dim / 4]
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.hidden_size, self.merge)
        self.output_width = cfg.out_hidden_size  # columns of an image's output (models/vit_dp.py)
        self.num_deepstack = 0  # Qwen3-VL's tower adds features for the first layers; this one none

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, patch_dim] -> its LM tokens [t*h*w / 4, out_hidden_size]."""
        t, h, w = grid_thw
        device = self.inv_freq.device
        window_index, window_cu = self._window_index(t, h, w)
        window_index = window_index.to(device)
        x = self._permute(
            self.patch_embed(pixel_values.to(device, self.patch_embed.weight.dtype)), window_index
        )
        freqs = self._permute(
            rotary_freqs(t, h, w, self.merge, self.inv_freq), window_index
        )  # [N, head_dim / 2]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        frame_cu = torch.arange(t + 1, dtype=torch.int64) * (h * w)
        full_mask = segment_mask(frame_cu, device) if t > 1 else None
        window_mask = segment_mask(window_cu, device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_mask if i in self.fullatt_blocks else window_mask)
        return self.merger(x)[torch.argsort(window_index)]

    def _permute(self, x: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        """Reorder merged units (groups of `unit` consecutive rows) into window order."""
        n = x.shape[0]
        return x.view(n // self.unit, self.unit, -1)[window_index].reshape(n, -1)

    def _window_index(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(merged-unit order that makes windows contiguous [t*h*w/unit], cumulative patch counts
        of the windows [num_windows + 1])."""
        lh, lw = h // self.merge, w // self.merge
        win = self.window_size // self.merge // self.patch_size  # merged units per window side
        index = torch.arange(t * lh * lw).view(t, lh, lw)
        pad_h, pad_w = -lh % win, -lw % win
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (lh + pad_h) // win, (lw + pad_w) // win
        windows = padded.view(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, win * win)
        sizes = (windows >= 0).sum(dim=1)  # [num_windows]
        order = windows[windows >= 0]
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0) * self.unit])
        return order, torch.unique_consecutive(cu)


def rotary_freqs(t: int, h: int, w: int, merge: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[t*h*w, head_dim / 2] angles: each patch's row rotates the first half, its column the
    second, patches listed merged unit by merged unit (the processor's order)."""
    m = merge
    hpos = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
    wpos = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
    pos = torch.stack([hpos, wpos], dim=-1).repeat(t, 1).to(inv_freq.device)  # [N, 2]
    freqs = pos.unsqueeze(-1).float() * inv_freq  # [N, 2, head_dim / 4]
    return freqs.flatten(1)


def segment_mask(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[N, N] bool: True where two rows lie in the same segment of the cumulative lengths `cu`."""
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff()).to(device)  # [N]
    return seg.unsqueeze(0) == seg.unsqueeze(1)
