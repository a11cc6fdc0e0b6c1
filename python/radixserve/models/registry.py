"""Model classes keyed by the `architectures` entry of a checkpoint's config.json."""

from __future__ import annotations

from torch import nn

from radixserve.model_loader.errors import ModelLoadError
from radixserve.models.bert import BertForSequenceClassification, BertModel
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.llama_eagle import LlamaForCausalLMEagle, LlamaForCausalLMEagle3
from radixserve.models.mixtral import MixtralForCausalLM
from radixserve.models.olmoe import OlmoeForCausalLM
from radixserve.models.qwen2 import Qwen2ForCausalLM
from radixserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from radixserve.models.qwen2_moe import Qwen2MoeForCausalLM
from radixserve.models.qwen3 import Qwen3ForCausalLM
from radixserve.models.qwen3_moe import Qwen3MoeForCausalLM
from radixserve.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration
from radixserve.models.sequence_classification import (
    LlamaForSequenceClassification,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)
from radixserve.models.xlm_roberta import XLMRobertaForSequenceClassification, XLMRobertaModel

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # EAGLE / EAGLE3 draft heads: loaded only as --speculative-draft-model-path (eagle_draft.py)
    "LlamaForCausalLMEagle": LlamaForCausalLMEagle,
    "LlamaForCausalLMEagle3": LlamaForCausalLMEagle3,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Images in (docs/multimodal.md)
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
    # Mixture-of-experts (models/moe_decoder.py)
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(
            f"Unsupported model architecture {architecture!r}. Supported architectures: {supported}"
        ) from None
