"""The outputs of a prefill-only (embedding) forward, one float32 vector per request:

- a scoring request (label_token_ids set): the next-token logprobs of its labels at its last
  position (needs the LM head of a generation model);
- otherwise the model's pooled state (configs/pooling.py), through the classifier head when the
  model has one, L2-normalised when the model's config says so.

The vectors are numpy float32 rows, not Python float lists: they travel to the TokenizerManager
pickled as raw bytes (a list pickles ~9 bytes per float and costs a Python object each), and the
HTTP routes write them as JSON at float32 precision or as base64 bytes straight from memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from radixserve.configs.pooling import EmbeddingConfig
from radixserve.layers.pooler import label_logprobs, normalize, pool, segment_bounds

_EMPTY = np.empty(0, dtype=np.float32)


def embedding_outputs(
    model: nn.Module,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None,
    config: EmbeddingConfig,
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    extend_lens: Sequence[int],  # [bs]
    label_token_ids: Sequence[Sequence[int] | None] | None,  # [bs] or None
) -> list[np.ndarray]:
    """[bs] float32 vectors (empty for a request that has none)."""
    bs = len(extend_lens)
    labels = list(label_token_ids) if label_token_ids is not None else [None] * bs
    out: list[np.ndarray] = [_EMPTY] * bs
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
        rows = pooled.to("cpu", torch.float32).numpy()  # [n, dim]; its rows are C-contiguous views
        for i, v in zip(pool_rows, rows):
            out[i] = v
    return out
