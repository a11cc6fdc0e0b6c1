"""What a model that does not generate returns, decided once from its folder (seed 000 §17).

A checkpoint is a non-generation model when its architecture is one (`*ForSequenceClassification`,
`BertModel`, `XLMRobertaModel`) or when the server runs with `--is-embedding` (a decoder such as Qwen3-Embedding
ships as `Qwen3ForCausalLM`). How its hidden states become one vector per input:

- the sentence-transformers files, when the folder has them: `modules.json` lists a `Normalize`
  module when vectors are L2-normalised, and the Pooling module's `config.json` names the mode
  (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`);
- otherwise SGLang's defaults: last token for decoders, CLS for encoders, both normalised;
  classification heads return their raw logits (one per label), never normalised.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

logger = logging.getLogger(__name__)

# Architectures that never generate: served as embedding/classification models without a flag.
CLASSIFICATION_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)
ENCODER_ARCHITECTURES: tuple[str, ...] = (
    "BertModel",
    "BertForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
)
# XLM-RoBERTa numbers positions from pad_token_id + 1 (models/xlm_roberta.py).
ROBERTA_ARCHITECTURES: tuple[str, ...] = ("XLMRobertaModel", "XLMRobertaForSequenceClassification")
NON_GENERATION_ARCHITECTURES: tuple[str, ...] = (
    *CLASSIFICATION_ARCHITECTURES,
    "BertModel",
    "XLMRobertaModel",
)


class PoolingType(str, Enum):
    LAST = "last"  # the last token's hidden state (decoders: it has seen every token)
    MEAN = "mean"  # the mean over every token of the input
    CLS = "cls"  # the first token's hidden state (encoders: bidirectional, it sees everything)

    @property
    def needs_all_tokens(self) -> bool:
        """Whether every token's hidden state is needed in one forward: no cached prefix (its
        hidden states are not kept) and no chunking."""
        return self is not PoolingType.LAST


@dataclass(frozen=True)
class EmbeddingConfig:
    pooling: PoolingType
    normalize: bool
    is_classifier: bool  # the output is a head's logits ([num_labels]), not a pooled hidden state
    is_causal: bool  # False: bidirectional attention (encoders); their KV is never shared
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    # Matryoshka-trained models accept `dimensions`: None = not trained so (refused), () = any
    # size up to the hidden size, else the listed sizes.
    matryoshka_dimensions: tuple[int, ...] | None = None

    def describe(self) -> str:
        if self.is_classifier:
            return f"classifier ({self.num_labels} labels, {self.pooling.value} pooling)"
        return f"embedding ({self.pooling.value} pooling, normalize={self.normalize})"


def is_generation_model(architecture: str, is_embedding: bool) -> bool:
    return architecture not in NON_GENERATION_ARCHITECTURES and not is_embedding


def resolve_embedding_config(path: str, architecture: str, hf_config: Any) -> EmbeddingConfig:  # noqa: ANN401
    is_encoder = architecture in ENCODER_ARCHITECTURES
    is_classifier = architecture in CLASSIFICATION_ARCHITECTURES
    default = PoolingType.CLS if is_encoder else PoolingType.LAST
    st = _read_sentence_transformers(path)
    pooling, normalize = st if st is not None else (default, not is_classifier)
    if is_classifier:
        # HF's heads pool the way the architecture does (BERT: the CLS token through its pooler;
        # XLM-R: the CLS token through its head; decoders: the last token), whatever a
        # sentence-transformers file says, and stay raw.
        pooling, normalize = default, False
    num_labels = int(getattr(hf_config, "num_labels", 0) or 0) if is_classifier else 0
    raw_labels = getattr(hf_config, "id2label", None) or {}
    id2label = {int(k): str(v) for k, v in raw_labels.items()} if is_classifier else {}
    return EmbeddingConfig(
        pooling=pooling,
        normalize=normalize,
        is_classifier=is_classifier,
        is_causal=not is_encoder,
        num_labels=num_labels,
        id2label=id2label,
        matryoshka_dimensions=_matryoshka(hf_config),
    )


def _matryoshka(hf_config: Any) -> tuple[int, ...] | None:  # noqa: ANN401
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def _read_sentence_transformers(path: str) -> tuple[PoolingType, bool] | None:
    """(pooling, normalize) from sentence-transformers' modules.json, or None without one."""
    modules_path = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    try:
        with open(modules_path, encoding="utf-8") as f:
            modules = json.load(f)
        pooling = PoolingType.LAST
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        for m in modules:
            if str(m.get("type", "")).endswith("Pooling"):
                pooling = _pooling_mode(os.path.join(path, m.get("path", ""), "config.json"))
        return pooling, normalize
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("Ignoring unreadable sentence-transformers config in %s: %s", path, exc)
        return None


def _pooling_mode(config_path: str) -> PoolingType:
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("pooling_mode_lasttoken"):
        return PoolingType.LAST
    if cfg.get("pooling_mode_cls_token"):
        return PoolingType.CLS
    if cfg.get("pooling_mode_mean_tokens"):
        return PoolingType.MEAN
    mode = cfg.get("pooling_mode")  # newer files name it directly
    mapping = {"lasttoken": PoolingType.LAST, "cls": PoolingType.CLS, "mean": PoolingType.MEAN}
    if mode in mapping:
        return mapping[mode]
    raise ValueError(f"unsupported sentence-transformers pooling in {config_path}: {cfg}")
