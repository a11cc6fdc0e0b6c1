"""Decoders that do not generate: `*ForSequenceClassification` (reward models, classifiers) and the
embedding variants `--is-embedding` serves (Qwen3-Embedding ships as Qwen3ForCausalLM).

Both are the decoder stack without an LM head. A classifier adds HF's `score` projection
(hidden_size -> num_labels, no bias), applied to the pooled (last-token) hidden state, which is
what HF computes: it projects every position and then reads the last non-padding one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.linear import Linear
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.qwen2 import Qwen2ForCausalLM
from radixserve.models.qwen3 import Qwen3ForCausalLM


class LlamaForSequenceClassification(LlamaForCausalLM):
    has_lm_head = False

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        super().__init__(config, max_position, parallel)
        # Replicated on every tensor-parallel rank: the pooled state is complete after all-reduce.
        self.score = Linear(config.hidden_size, int(config.num_labels), bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[bs, hidden_size] pooled states -> [bs, num_labels] logits."""
        return self.score(pooled)


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    qkv_bias = Qwen2ForCausalLM.qkv_bias


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm = Qwen3ForCausalLM.qk_norm


def embedding_variant(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` without its LM head, for --is-embedding (the pooled hidden state is the output)."""
    if not getattr(cls, "has_lm_head", False):
        return cls
    return type(f"{cls.__name__}AsEmbedding", (cls,), {"has_lm_head": False})
