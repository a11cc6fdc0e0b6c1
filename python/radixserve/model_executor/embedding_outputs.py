"""The outputs of a prefill-only (embedding) forward, one list of floats per request:

- a scoring request (label_token_ids set): the next-token logprobs of its labels at its last
  position (needs the LM head of a generation model);
- otherwise the model's pooled state (configs/pooling.py), through the classifier head when the
  model has one, L2-normalised when the model's config says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from radixserve.configs.pooling import EmbeddingConfig
from radixserve.layers.pooler import label_logprobs, normalize, pool, segment_bounds


def embedding_outputs(
    model: nn.Module,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None,
    config: EmbeddingConfig,
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    extend_lens: Sequence[int],  # [bs]
    label_token_ids: Sequence[Sequence[int] | None] | None,  # [bs] or None
) -> list[list[float]]:
    bs = len(extend_lens)
    labels = list(label_token_ids) if label_token_ids is not None else [None] * bs
    out: list[list[float]] = [[] for _ in range(bs)]
    score_rows = [i for i, ids in enumerate(labels) if ids is not None]
    pool_rows = [i for i, ids in enumerate(labels) if ids is None]
    if score_rows:
        if lm_head is None:
            raise RuntimeError("scoring label tokens needs a generation model's LM head")
        _, ends = segment_bounds(extend_lens, hidden.device)
        rows = torch.tensor(score_rows, dtype=torch.int64, device=hidden.device)
        values = label_logprobs(hidden[ends[rows] - 1], lm_head, [labels[i] or [] for i in score_rows])
        for i, v in zip(score_rows, values):
            out[i] = v
    if pool_rows:
        pooled = pool(hidden, extend_lens, config.pooling)  # [bs, hidden_size] fp32
        pooled = pooled[torch.tensor(pool_rows, dtype=torch.int64, device=hidden.device)]
        if config.is_classifier:
            pooled = model.classify(pooled.to(hidden.dtype)).float()  # [n, num_labels]
        if config.normalize:
            pooled = normalize(pooled)
        for i, v in zip(pool_rows, pooled.tolist()):
            out[i] = v
    return out
