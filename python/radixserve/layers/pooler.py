"""From a prefill's hidden states to one output per request: pooled embeddings, classifier logits,
or next-token label logprobs (/v1/score).

The hidden states of a batch are the extend tokens of every request, concatenated
([num_tokens, hidden_size]); request b owns the rows of its extend_len. Last-token pooling needs
only its last row, so it works on top of a cached prefix and after chunks; mean and CLS pooling
need every row (the scheduler never gives those requests a prefix or a chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.configs.pooling import PoolingType


def segment_bounds(extend_lens: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, ends) [bs] of each request's rows in the batch's hidden states."""
    lens = torch.tensor(list(extend_lens), dtype=torch.int64, device=device)
    ends = torch.cumsum(lens, 0)
    return ends - lens, ends


def pooled_rows(
    extend_lens: Sequence[int], pooling: PoolingType, device: torch.device
) -> torch.Tensor | None:
    """[bs] the one row of each request that `pooling` reads (LAST: its last, CLS: its first), or
    None when it reads every row (MEAN)."""
    if pooling is PoolingType.MEAN:
        return None
    starts, ends = segment_bounds(extend_lens, device)
    return ends - 1 if pooling is PoolingType.LAST else starts


def pool(hidden: torch.Tensor, extend_lens: Sequence[int], pooling: PoolingType) -> torch.Tensor:
    """[bs, hidden_size] in float32: the pooled state of each request."""
    starts, ends = segment_bounds(extend_lens, hidden.device)
    if pooling is PoolingType.LAST:
        return hidden[ends - 1].float()
    if pooling is PoolingType.CLS:
        return hidden[starts].float()
    lens = ends - starts  # [bs]
    segment = torch.repeat_interleave(torch.arange(len(extend_lens), device=hidden.device), lens)
    sums = torch.zeros(len(extend_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segment, hidden.float())
    return sums / lens.clamp(min=1).to(torch.float32)[:, None]


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """L2 normalisation as sentence-transformers' Normalize module does it (eps 1e-12)."""
    return F.normalize(vectors, p=2.0, dim=-1)


def label_logprobs(
    last_hidden: torch.Tensor,  # [n, hidden_size] the last row of each scoring request
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    label_token_ids: Sequence[Sequence[int]],  # [n] ids per request
) -> list[np.ndarray]:
    """Log-softmax over the whole vocabulary at the next position, read at each request's labels
    (float32 vectors)."""
    logprobs = torch.log_softmax(lm_head(last_hidden).float(), dim=-1)  # [n, vocab]
    return [logprobs[i, list(ids)].cpu().numpy() for i, ids in enumerate(label_token_ids)]
