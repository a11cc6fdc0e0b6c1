"""M-RoPE against transformers' rotary embeddings: Qwen3-VL's interleaved layout (and Qwen2.5-VL's
sectioned one through the same class) on random 3-D positions, and 1-D positions equal to plain
RoPE in both layouts (text-only batches take the parent's path)."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.mrope import MRotaryEmbedding

HEAD_DIM, HEADS, TOKENS = 32, 2, 11


def _hf_rotate(config, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    """transformers' Qwen3-VL text rotary and its apply, on q/k [T, heads, head_dim]."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cos, sin = Qwen3VLTextRotaryEmbedding(config)(q, positions.unsqueeze(1))  # [1, T, head_dim]
    q2, k2 = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q2[0].transpose(0, 1), k2[0].transpose(0, 1)


@pytest.mark.parametrize("section", [[8, 4, 4], [6, 5, 5], [16, 0, 0]])
def test_interleaved_matches_qwen3_vl(section: list[int]) -> None:
    from transformers import Qwen3VLTextConfig

    rope = {"rope_type": "default", "rope_theta": 5000.0, "mrope_section": section, "mrope_interleaved": True}
    config = Qwen3VLTextConfig(head_dim=HEAD_DIM, hidden_size=64, num_attention_heads=2, rope_parameters=rope)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, TOKENS, HEADS, HEAD_DIM, generator=gen)
    positions = torch.randint(0, 300, (3, TOKENS), generator=gen)
    ours = MRotaryEmbedding(HEAD_DIM, 512, 5000.0, section, interleaved=True)(positions, q.clone(), k.clone())
    for got, want in zip(ours, _hf_rotate(config, q, k, positions)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if section[1]:  # the layout matters: the sectioned one differs on these positions
        sectioned = MRotaryEmbedding(HEAD_DIM, 512, 5000.0, section)(positions, q.clone(), k.clone())
        assert not torch.allclose(sectioned[0], ours[0], atol=1e-3)


@pytest.mark.parametrize("interleaved", [False, True])
def test_equal_axes_are_plain_rope(interleaved: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, TOKENS, HEADS, HEAD_DIM, generator=gen)
    positions = torch.randint(0, 300, (TOKENS,), generator=gen)
    rope = MRotaryEmbedding(HEAD_DIM, 512, 5000.0, [6, 5, 5], interleaved=interleaved)
    three = rope(positions.expand(3, -1), q.clone(), k.clone())
    one = rope(positions, q.clone(), k.clone())
    for a, b in zip(three, one):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
