"""BERT-style encoders (BertModel for embeddings, BertForSequenceClassification for cross-encoder
rerankers and classifiers), run through the same paged KV pool and attention backends as the
decoders, with bidirectional attention (ForwardBatch.attn_causal is False for them).

Post-LayerNorm blocks, absolute position embeddings and segment (token_type) embeddings, as HF's
BertModel. Parameter names follow HF's (a `bert.` prefix is stripped), so loading is a plain copy.
The encoder has no LM head and never decodes; its KV is never shared between requests (a token's
KV depends on the tokens after it), so the scheduler gives its requests no cached prefix.
Single rank only (no tensor or pipeline parallelism).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.activation import ACTIVATIONS
from radixserve.layers.attention.encoder import attends_own_kv, pooled_row_attention
from radixserve.layers.attention.radix_attention import RadixAttention
from radixserve.layers.linear import Linear
from radixserve.model_loader.errors import ModelLoadError, copy_checked
from radixserve.model_loader.weights import CheckpointTensor

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:  # noqa: ANN401 - an HF BertConfig
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids).add_(self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x.add_(self.position_embeddings(positions)))  # [num_tokens, hidden_size]


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:  # noqa: ANN401
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.query = Linear(hidden, hidden)
        self.key = Linear(hidden, hidden)
        self.value = Linear(hidden, hidden)
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, layer_id
        )

    def forward(
        self, x: torch.Tensor, forward_batch: ForwardBatch, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[num_tokens, hidden_size], or [len(rows), hidden_size]: the attention output of those
        rows (one per request) only."""
        shape = (-1, self.num_heads, self.head_dim)
        k, v = self.key(x).view(shape), self.value(x).view(shape)
        if rows is not None and attends_own_kv(forward_batch):
            # Only the pooled rows' queries (the cpu backend): the last layer's query projection
            # and attention, ~2.5% of a bge-small forward on one thread.
            assert forward_batch.extend_seq_lens_cpu is not None
            q = self.query(x[rows]).view(shape)
            return pooled_row_attention(q, k, v, forward_batch.extend_seq_lens_cpu, self.attn)
        out = self.attn(self.query(x).view(shape), k, v, forward_batch)
        return out if rows is None else out[rows]


class BertDenseLayerNorm(nn.Module):
    """dense -> add the residual -> LayerNorm (HF's BertSelfOutput and BertOutput)."""

    def __init__(self, in_features: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # In place: the projection's output is a fresh tensor, and a second [num_tokens, hidden]
        # buffer per block is measurable at prefill sizes.
        return self.LayerNorm(self.dense(x).add_(residual))


class BertAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:  # noqa: ANN401
        super().__init__()
        self.self = BertSelfAttention(config, layer_id)
        self.output = BertDenseLayerNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, forward_batch: ForwardBatch, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[num_tokens, hidden_size], or [len(rows), hidden_size] for those rows only: attention
        reads every token's K/V, and past it each row is computed on its own."""
        attended = self.self(x, forward_batch, rows)
        return self.output(attended, x if rows is None else x[rows])


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:  # noqa: ANN401
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        act = getattr(config, "hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"Unsupported BERT activation {act!r} (supported: {sorted(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense.forward_act(x, self.act)  # on CPU, in the GEMM's epilogue


class BertLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:  # noqa: ANN401
        super().__init__()
        self.attention = BertAttention(config, layer_id)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseLayerNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, forward_batch: ForwardBatch, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.attention(x, forward_batch, rows)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:  # noqa: ANN401
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        *inner, last = self.layer
        for layer in inner:
            x = layer(x, forward_batch)
        # The pooling reads one row per request (CLS, or the last token): the last layer computes
        # those rows only past its K/V projections (BertSelfAttention), ~85% of that layer's work
        # saved on the cpu backend, ~70% on torch_native (which attends every query).
        return last(x, forward_batch, forward_batch.output_rows)


class BertPooler(nn.Module):
    """HF's pooler: tanh(dense(CLS state)); the classification head reads it."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size)

    def forward(self, cls_state: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_state))


class BertModel(nn.Module):
    """The encoder; forward returns the last layer's states [num_tokens, hidden_size], or only
    the rows in `forward_batch.output_rows` ([len(output_rows), hidden_size]) when it is set."""

    lm_head = None  # never generates
    returns_output_rows = True  # honours ForwardBatch.output_rows
    # Weights a checkpoint may carry that this class does not need (BertModel's pooler output is
    # not an embedding: sentence-transformers pools the last states itself).
    optional_prefixes: tuple[str, ...] = ("pooler.",)
    checkpoint_prefix = "bert."  # what HF's heads put before the encoder's weight names
    embeddings_class: type[nn.Module] = BertEmbeddings
    has_pooler = True  # HF's pooler (tanh(dense(CLS))); RoBERTa's classification heads have none

    def __init__(self, config: Any) -> None:  # noqa: ANN401
        super().__init__()
        self.config = config
        self.embeddings = self.embeddings_class(config)
        self.encoder = BertEncoder(config)
        if self.has_pooler:
            self.pooler = BertPooler(config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        pp_proxy: object = None,
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, forward_batch.token_type_ids)
        return self.encoder(x, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, value in weights:
            name = name.removeprefix(self.checkpoint_prefix)
            if name.endswith(("position_ids", "token_type_ids")):
                continue  # HF's constant buffers
            if name not in params:
                raise ModelLoadError(
                    f"Checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}"
                )
            copy_checked(params[name].data, CheckpointTensor.of(name, value).full(), name)
            loaded.add(name)
        missing = sorted(n for n in set(params) - loaded if not n.startswith(self.optional_prefixes))
        if missing:
            raise ModelLoadError(f"Checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")


class BertForSequenceClassification(BertModel):
    """Cross-encoder rerankers and classifiers: classifier(pooler(CLS state))."""

    optional_prefixes = ()

    def __init__(self, config: Any) -> None:  # noqa: ANN401
        super().__init__(config)
        self.classifier = Linear(config.hidden_size, int(config.num_labels))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[bs, hidden_size] CLS states -> [bs, num_labels] logits."""
        return self.classifier(self.pooler(pooled))
