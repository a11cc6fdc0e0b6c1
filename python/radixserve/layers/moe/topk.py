"""Router top-k: softmax over the router logits, the k largest probabilities, optionally
renormalised to sum to 1 (HF's `norm_topk_prob`; Mixtral always renormalises)."""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (topk_weights [num_tokens, top_k] fp32,
    topk_ids [num_tokens, top_k] int64). Softmax runs in fp32 whatever the model dtype, as HF's
    routers do, so bf16 models route as their HF twins."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [num_tokens, num_experts]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
