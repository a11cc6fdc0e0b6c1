"""hf_greedy_cached (HF's KV cache, one new token a step), the reference of the built-in model's
parity tests, against hf_greedy (the whole sequence recomputed every step) on tiny random models:
the same tokens, and log-probabilities that differ only by fp32 summation order."""

from __future__ import annotations

import pytest
import torch

from radixserve.testing.tiny_models import hf_greedy, hf_greedy_cached, make_tiny_model

PROMPTS = [[5, 17, 99, 120, 33, 7, 250, 61, 3, 44], [9, 2, 200]]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cached_reference_equals_full_recomputation(kind: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(kind, tmp_path / kind, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        full_ids, full_lps = hf_greedy(hf, prompt, 24)
        cached_ids, cached_lps = hf_greedy_cached(hf, prompt, 24)
        assert cached_ids == full_ids
        assert max(abs(a - b) for a, b in zip(full_lps, cached_lps)) < 1e-4
