"""XLM-RoBERTa encoders: XLMRobertaModel (bge-m3, multilingual-e5 embeddings) and
XLMRobertaForSequenceClassification (bge-reranker and other cross-encoder rerankers).

The same post-LayerNorm encoder as BERT (models/bert.py), with three differences from HF's
XLM-RoBERTa:

- position ids count from `pad_token_id + 1` and padding tokens take position `pad_token_id`
  (fairseq's convention), so a model with `max_position_embeddings` 514 and pad id 1 takes 512
  tokens (configs/model_config.py derives the context length so);
- one token type (`type_vocab_size` 1): pairs are `<s> A </s></s> B </s>`, all segment 0;
- the classification head reads the CLS state through dense -> tanh -> out_proj
  (RobertaClassificationHead), with no pooler.

Weight names follow HF's with the `roberta.` prefix stripped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixserve.layers.linear import Linear
from radixserve.models.bert import BertEmbeddings, BertModel


def roberta_positions(input_ids: torch.Tensor, positions: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """HF's create_position_ids_from_input_ids for every request of a flat batch: a request's
    non-padding tokens are numbered padding_idx + 1, + 2, ... and its padding tokens get
    padding_idx. `positions` run 0.. within each request (an encoder's request never has a cached
    prefix or a chunk), so a token's request starts at its flat index minus its position."""
    mask = input_ids.ne(padding_idx).to(torch.int64)
    counts = torch.cumsum(mask, 0)  # non-padding tokens up to each token, over the whole batch
    before = counts - mask  # ... strictly before it
    starts = torch.arange(input_ids.shape[0], device=input_ids.device) - positions
    return (counts - before[starts]) * mask + padding_idx


class XLMRobertaEmbeddings(BertEmbeddings):
    def __init__(self, config: Any) -> None:  # noqa: ANN401
        super().__init__(config)
        self.padding_idx = int(config.pad_token_id)
        # One segment: a tokenizer that still labels a pair's second half 1 must not index past it.
        self.single_type = int(config.type_vocab_size) == 1

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        positions = roberta_positions(input_ids, positions, self.padding_idx)
        return super().forward(input_ids, positions, None if self.single_type else token_type_ids)


class XLMRobertaModel(BertModel):
    """The encoder; forward returns the last layer's states, as BertModel's does."""

    checkpoint_prefix = "roberta."
    embeddings_class = XLMRobertaEmbeddings


class RobertaClassificationHead(nn.Module):
    """out_proj(tanh(dense(CLS state))), HF's RobertaClassificationHead without its dropouts."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size)
        self.out_proj = Linear(hidden_size, num_labels)

    def forward(self, cls_state: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_state)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """Cross-encoder rerankers and classifiers: classifier(CLS state)."""

    optional_prefixes = ()
    has_pooler = False

    def __init__(self, config: Any) -> None:  # noqa: ANN401
        super().__init__(config)
        self.classifier = RobertaClassificationHead(config.hidden_size, int(config.num_labels))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[bs, hidden_size] CLS states -> [bs, num_labels] logits."""
        return self.classifier(pooled)
