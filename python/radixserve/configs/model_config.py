"""What the engine needs to know about a model, read once from its HF-format folder."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.configs import hf_config_cache
from radixserve.configs.architectures import TEXT_DECODER_ARCHITECTURES
from radixserve.configs.checkpoint_quant import CheckpointQuant, checkpoint_quantization
from radixserve.configs.pooling import (
    ENCODER_ARCHITECTURES,
    NON_GENERATION_ARCHITECTURES,
    ROBERTA_ARCHITECTURES,
    EmbeddingConfig,
    is_generation_model,
    resolve_embedding_config,
)
from radixserve.model_loader.errors import ModelLoadError, unsupported_architecture_error

logger = logging.getLogger(__name__)

# Models that take images: their shapes are the text config's (config.json's text_config).
VISION_LANGUAGE_ARCHITECTURES: tuple[str, ...] = (
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)
# HF `architectures` names that radixserve/models implements. The registry there is the source of
# truth for classes; this list lets config validation fail before any model code is imported.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    *TEXT_DECODER_ARCHITECTURES,
    *VISION_LANGUAGE_ARCHITECTURES,
    *NON_GENERATION_ARCHITECTURES,
)
# Draft heads: loadable only as --speculative-draft-model-path (ModelConfig.from_path(draft_head=True)).
EAGLE_HEAD_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLMEagle", "LlamaForCausalLMEagle3")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# Config keys that different model families use for the trained context length, in priority order.
_CONTEXT_LEN_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
_DEFAULT_CONTEXT_LEN = 2048


@dataclass(frozen=True)
class ModelConfig:
    path: str
    # PretrainedConfig defines __eq__ without __hash__; keep it out of eq/hash so ModelConfig hashes.
    hf_config: Any = field(compare=False, repr=False)
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_len: int
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    # False for embedding / classification models (--is-embedding or a non-generating architecture).
    is_generation: bool = True
    embedding: EmbeddingConfig | None = None  # how such a model pools (None for generation models)
    # How a pre-quantized checkpoint stores its linears (config.json's quantization_config).
    quantization: CheckpointQuant | None = None

    @classmethod
    def from_path(
        cls,
        path: str,
        context_length: int | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        is_embedding: bool = False,
        draft_head: bool = False,
    ) -> ModelConfig:
        """Read `path`/config.json (never the hub) and derive every shape the engine sizes from."""
        path = _check_model_dir(path)
        hf_config = load_hf_config(path)
        architecture = _get_architecture(hf_config, path, draft_head)
        text = hf_config.get_text_config() if architecture in VISION_LANGUAGE_ARCHITECTURES else hf_config
        num_heads = int(text.num_attention_heads)
        hidden_size = int(text.hidden_size)
        is_generation = is_generation_model(architecture, is_embedding)
        embedding = None if is_generation else resolve_embedding_config(path, architecture, hf_config)
        return cls(
            path=path,
            hf_config=hf_config,
            architecture=architecture,
            num_layers=int(text.num_hidden_layers),
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or num_heads),
            head_dim=_get_head_dim(text, hidden_size, num_heads),
            vocab_size=int(text.vocab_size),
            context_len=_get_context_len(text, context_length, architecture),
            dtype=resolve_dtype(dtype, device, _config_dtype(hf_config)),
            eos_token_ids=_get_eos_token_ids(text, path),
            is_generation=is_generation,
            embedding=embedding,
            quantization=_checkpoint_quantization(path),
        )


def _checkpoint_quantization(path: str) -> CheckpointQuant | None:
    try:
        return checkpoint_quantization(path)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def _check_model_dir(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        raise ModelLoadError(
            f"Model path {path} does not exist. radixserve loads local HF-format folders only "
            "(it never downloads); pass --model-path to a folder with config.json and "
            "*.safetensors, or omit it to use the built-in SmolLM2-135M-Instruct."
        )
    if not os.path.isdir(path):
        raise ModelLoadError(f"Model path {path} is a file; expected a folder with config.json and weights.")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(
            f"No config.json in {path}. Expected an HF-format model folder "
            "(config.json, *.safetensors, tokenizer files)."
        )
    return path


def load_hf_config(path: str) -> Any:
    """transformers.AutoConfig from a local folder, with hub access ruled out; for a text model
    whose config.json an earlier process read, its cached answer (configs/hf_config_cache.py)."""
    cached = hf_config_cache.read_cached(path)
    if cached is not None:
        return cached
    try:
        config = hf_config_cache.autoconfig(path)
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError depending on the defect
        raise ModelLoadError(f"Cannot read {path}/config.json: {exc}") from exc
    hf_config_cache.remember(path, config)
    return config


def _get_architecture(hf_config: Any, path: str, draft_head: bool = False) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    if draft_head and architecture in EAGLE_HEAD_ARCHITECTURES:
        return architecture
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise unsupported_architecture_error(architecture, SUPPORTED_ARCHITECTURES, path)
    return architecture


def _get_head_dim(hf_config: Any, hidden_size: int, num_heads: int) -> int:
    # Qwen3 sets head_dim independently of hidden_size / heads, so prefer the explicit value.
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    if hidden_size % num_heads:
        raise ModelLoadError(
            f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads} and "
            "config.json has no head_dim."
        )
    return hidden_size // num_heads


def _get_context_len(hf_config: Any, context_length: int | None, architecture: str = "") -> int:
    derived = next(
        (int(v) for k in _CONTEXT_LEN_KEYS if (v := getattr(hf_config, k, None)) is not None),
        _DEFAULT_CONTEXT_LEN,
    )
    if architecture in ROBERTA_ARCHITECTURES:
        # Its positions start after pad_token_id: 514 rows and pad id 1 hold 512 tokens.
        derived -= int(getattr(hf_config, "pad_token_id", None) or 0) + 1
    if context_length is None:
        return derived
    if context_length <= 0:
        raise ModelLoadError(f"context_length must be positive, got {context_length}.")
    if context_length > derived and architecture in ENCODER_ARCHITECTURES:
        # A learned position table has no row past its end: a longer input would fail in the
        # forward (an index error), so refuse at start-up instead of on the first long request.
        raise ModelLoadError(
            f"context_length {context_length} exceeds what {architecture}'s position embeddings "
            f"hold ({derived} tokens); omit --context-length or set it to at most {derived}."
        )
    if context_length > derived:
        # Like SGLang we allow it (rope may extrapolate), but quality past the trained length is
        # not guaranteed, so say so once.
        logger.warning(
            "context_length %d exceeds the model's max_position_embeddings %d; outputs past %d "
            "tokens may be degraded.",
            context_length,
            derived,
            derived,
        )
    return int(context_length)


def resolve_dtype(dtype: str | torch.dtype, device: str, config_dtype: Any = None) -> torch.dtype:
    """Map a user dtype string to torch.dtype; "auto" is fp32 on CPU and half precision elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        if str(device).startswith("cpu"):
            # bf16/fp16 matmuls are far slower than fp32 on the CPUs we target.
            return torch.float32
        # Keep a checkpoint's fp16 if it was trained that way; everything else serves in bf16.
        return torch.float16 if _as_dtype(config_dtype) == torch.float16 else torch.bfloat16
    if name not in _DTYPE_NAMES:
        raise ModelLoadError(f"Unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16.")
    return _DTYPE_NAMES[name]


def _config_dtype(hf_config: Any) -> Any:
    # transformers 5 calls it `dtype` (reading `torch_dtype` there logs a deprecation warning);
    # 4.x called it `torch_dtype`.
    if hasattr(hf_config, "dtype"):
        return hf_config.dtype
    return getattr(hf_config, "torch_dtype", None)


def _as_dtype(value: Any) -> torch.dtype | None:
    if isinstance(value, torch.dtype) or value is None:
        return value
    return _DTYPE_NAMES.get(str(value).lower().removeprefix("torch."))


def _get_eos_token_ids(hf_config: Any, path: str) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos ids, config order first."""
    ids: list[int] = []
    for value in (getattr(hf_config, "eos_token_id", None), _read_generation_eos(path)):
        for token_id in _as_id_list(value):
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _read_generation_eos(path: str) -> Any:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return None
    try:
        with open(gen_path, encoding="utf-8") as f:
            return json.load(f).get("eos_token_id")
    except (OSError, ValueError) as exc:
        # A broken generation config only loses extra stop ids; do not refuse to serve over it.
        logger.warning("Ignoring unreadable %s: %s", gen_path, exc)
        return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
