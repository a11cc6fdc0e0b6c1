"""Tiny random checkpoints of the models that do not generate (embeddings, classifiers, rerankers),
loadable by radixserve, HF transformers and (where a pooling config ships) sentence-transformers.

    make_tiny_embedding_model("qwen3_last", path)   # Qwen3-Embedding style: last token, normalised
    make_tiny_embedding_model("llama_mean", path)   # mean pooling, not normalised
    make_tiny_embedding_model("llama_cls", path)    # LlamaForSequenceClassification (reward, 1 label)
    make_tiny_embedding_model("qwen2_cls", path)    # Qwen2ForSequenceClassification (3 labels)
    make_tiny_embedding_model("bert", path)         # BertModel, CLS pooling, normalised
    make_tiny_embedding_model("bert_cls", path)     # BertForSequenceClassification (cross-encoder)
    make_tiny_embedding_model("xlmr", path)         # XLMRobertaModel, mean pooling, normalised (e5)
    make_tiny_embedding_model("xlmr_cls", path)     # XLMRobertaForSequenceClassification (bge-reranker)
    make_tiny_embedding_model("qwen3_reranker", path)  # a Qwen3ForCausalLM with "yes"/"no" tokens
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from radixserve.testing.tiny_models import _COMMON, TINY_CONFIGS, TINY_VOCAB, write_tiny_tokenizer

# Decoder kinds: (base tiny config, HF auto class that writes the checkpoint, ST pooling, normalize)
_DECODERS: dict[str, tuple[str, str, str | None, bool]] = {
    # Saved from the bare Qwen3Model, as Qwen3-Embedding is (weights without the "model." prefix).
    "qwen3_last": ("qwen3", "AutoModel", "lasttoken", True),
    "llama_mean": ("llama", "AutoModel", "mean_tokens", False),
    "llama_cls": ("llama", "AutoModelForSequenceClassification", None, False),
    "qwen2_cls": ("qwen2", "AutoModelForSequenceClassification", None, False),
    "qwen3_reranker": ("qwen3", "AutoModelForCausalLM", None, False),
}
_ARCHITECTURES = {
    "qwen3_last": "Qwen3ForCausalLM",  # served with --is-embedding, as Qwen3-Embedding
    "llama_mean": "LlamaForCausalLM",
    "llama_cls": "LlamaForSequenceClassification",
    "qwen2_cls": "Qwen2ForSequenceClassification",
    "qwen3_reranker": "Qwen3ForCausalLM",
    "bert": "BertModel",
    "bert_cls": "BertForSequenceClassification",
    "xlmr": "XLMRobertaModel",
    "xlmr_cls": "XLMRobertaForSequenceClassification",
}
ENCODER_KINDS = ("bert", "bert_cls", "xlmr", "xlmr_cls")
_BERT: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "initializer_range": 0.25,
    "pad_token_id": 0,
}
# XLM-RoBERTa's differences: one token type, positions numbered from pad_token_id + 1 (the tiny
# tokenizer pads with id 0; real checkpoints with 1), 514 position rows, LayerNorm eps 1e-5.
_XLMR: dict[str, Any] = {
    **_BERT,
    "type_vocab_size": 1,
    "max_position_embeddings": 514,
    "layer_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Sentence-transformers pooling of the encoder embedding kinds: (mode, normalize).
_ENCODER_POOLING = {"bert": ("cls_token", True), "xlmr": ("mean_tokens", True)}
EMBEDDING_KINDS = tuple(_ARCHITECTURES)
RERANKER_VOCAB = TINY_VOCAB + 2  # the tokenizer's "yes" and "no" come after the BPE vocabulary


def make_tiny_embedding_model(
    kind: str, path: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a random `kind` checkpoint to `path`. `overrides` replace encoder config values
    (e.g. a benchmark's real model shape: hidden_size, num_hidden_layers, ...)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind in ENCODER_KINDS:
        config = _encoder_config(kind, overrides or {})
    elif overrides:
        raise ValueError(f"config overrides apply to the encoder kinds {ENCODER_KINDS}, not {kind!r}")
    else:
        config = _decoder_config(kind)
    cls = _auto_class(kind)
    model = cls(config) if kind in ENCODER_KINDS else cls.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    _fix_architecture(path, kind)
    _write_tokenizer(path, kind)
    if kind in _ENCODER_POOLING:
        mode, normalize = _ENCODER_POOLING[kind]
        write_sentence_transformers_files(path, mode, normalize, int(config.hidden_size))
    elif kind in _DECODERS and _DECODERS[kind][2] is not None:
        write_sentence_transformers_files(
            path, _DECODERS[kind][2], _DECODERS[kind][3], int(config.hidden_size)
        )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path


def _decoder_config(kind: str) -> Any:  # noqa: ANN401 - an HF PretrainedConfig
    from transformers import AutoConfig

    base = _DECODERS[kind][0]
    cfg = {**_COMMON, **TINY_CONFIGS[base], "pad_token_id": 0}
    cfg["architectures"] = [_ARCHITECTURES[kind]]
    if kind == "qwen2_cls":
        cfg["num_labels"] = 3
        cfg["id2label"] = {0: "negative", 1: "neutral", 2: "positive"}
        cfg["label2id"] = {v: k for k, v in cfg["id2label"].items()}
    elif kind == "llama_cls":
        cfg["num_labels"] = 1
    elif kind == "qwen3_reranker":
        cfg["vocab_size"] = RERANKER_VOCAB
    elif kind == "qwen3_last":
        cfg["matryoshka_dimensions"] = [16, 32, 64]  # trained so (pretend): `dimensions` is allowed
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def _encoder_config(kind: str, overrides: dict[str, Any]) -> Any:  # noqa: ANN401
    from transformers import BertConfig, XLMRobertaConfig

    extra = {"num_labels": 1} if kind.endswith("_cls") else {}
    if kind.startswith("xlmr"):
        return XLMRobertaConfig(architectures=[_ARCHITECTURES[kind]], **{**_XLMR, **overrides}, **extra)
    return BertConfig(architectures=[_ARCHITECTURES[kind]], **{**_BERT, **overrides}, **extra)


def _auto_class(kind: str) -> Any:  # noqa: ANN401
    import transformers

    if kind in ENCODER_KINDS:
        return getattr(transformers, _ARCHITECTURES[kind])
    return getattr(transformers, _DECODERS[kind][1])


def _randomize(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.uniform_(0.5, 1.5)  # non-trivial norms catch a missing or misplaced norm
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif param.dim() == 2:
                param.normal_(0.0, 0.25 if "embed" not in name else 1.0)


def _fix_architecture(path: Path, kind: str) -> None:
    """config.json names the architecture radixserve serves (AutoModel writes e.g. Qwen3Model)."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = [_ARCHITECTURES[kind]]
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _write_tokenizer(path: Path, kind: str) -> None:
    write_tiny_tokenizer(path)
    if kind in ENCODER_KINDS:
        write_encoder_pair_template(path, roberta=kind.startswith("xlmr"))
    elif kind == "qwen3_reranker":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        tok.add_tokens(["yes", "no"])  # single tokens, as in Qwen3's vocabulary
        tok.save_pretrained(str(path))


def write_encoder_pair_template(path: str | Path, roberta: bool = False) -> None:
    """Make the tokenizer saved in `path` an encoder's, <|im_start|> as CLS and <|im_end|> as SEP.
    BERT: "<cls> A <sep>" and, for pairs, "B <sep>" with token type 1. RoBERTa:
    "<cls> A <sep><sep> B <sep>", one token type, and no token_type_ids in its outputs."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    backend = tok.backend_tokenizer
    cls_id, sep_id = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    pair = (
        "<|im_start|> $A <|im_end|> <|im_end|> $B <|im_end|>"
        if roberta
        else "<|im_start|> $A <|im_end|> $B:1 <|im_end|>:1"
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>",
        pair=pair,
        special_tokens=[("<|im_start|>", cls_id), ("<|im_end|>", sep_id)],
    )
    if roberta:
        tok.model_input_names = ["input_ids", "attention_mask"]
    tok.save_pretrained(str(path))


def write_sentence_transformers_files(path: str | Path, mode: str, normalize: bool, dimension: int) -> None:
    """modules.json (Transformer, Pooling, and Normalize when `normalize`) and the Pooling
    module's config with `pooling_mode_<mode>` ("cls_token", "mean_tokens", "lasttoken")."""
    path = Path(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": dimension,
        "pooling_mode_cls_token": mode == "cls_token",
        "pooling_mode_mean_tokens": mode == "mean_tokens",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": mode == "lasttoken",
        "include_prompt": True,
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 512, "do_lower_case": False})
    )


def hf_reference(kind: str, path: str | Path) -> Any:  # noqa: ANN401 - an HF model in eval mode
    """The HF model radixserve's outputs are compared with: the bare model for embeddings (its
    last hidden states are pooled by the test), the classification or causal LM otherwise."""
    return _auto_class(kind).from_pretrained(str(path)).eval()
