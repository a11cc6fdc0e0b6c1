"""Rotary position embeddings (neox style, as Llama/Qwen use), incl. Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from radixserve.layers.cpu_fused import cpu_kernels, fusable
from radixserve.layers.gpu_fused import triton_ops


def rope_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from a config of transformers 4.x (rope_theta/rope_scaling) or 5.x
    (rope_parameters)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or params or None
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
    return float(theta), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 scaling: long wavelengths are divided by `factor`, short kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position once; forward gathers them by position."""

    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        # fp32 throughout, computed the way HF transformers does, so positions match bit for bit.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif rope_type == "linear":
                inv_freq = inv_freq / scaling["factor"]
            else:
                raise ValueError(f"Unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq.float())  # [max_position, head_dim / 2]
        self.register_buffer("cos_cached", freqs.cos(), persistent=False)
        self.register_buffer("sin_cached", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; q [num_tokens, num_heads, head_dim]; k [num_tokens, num_kv_heads, head_dim].

        The compiled CPU path rotates q and k in place (views of the layer's fresh qkv output)."""
        if (ops := triton_ops(q)) is not None:
            return ops.rotary_embedding(positions, q, k, self.cos_cached, self.sin_cached)
        if q.stride(-1) == 1 and k.stride(-1) == 1 and fusable(q, k, self.cos_cached):
            cpu_kernels.rotary_neox_(positions, q, k, self.cos_cached, self.sin_cached)
            return q, k
        return self.forward_native(positions, q, k)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference; returns new tensors."""
        cos = self.cos_cached[positions].unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin_cached[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Neox layout: the first and second halves of head_dim form the (real, imag) pairs.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
