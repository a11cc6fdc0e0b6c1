"""Tiny random checkpoints of the models that do not generate (embeddings, classifiers, rerankers),
loadable by radixserve, HF transformers and (where a pooling config ships) sentence-transformers.

    make_tiny_embedding_model("qwen3_last", path)   # Qwen3-Embedding style: last token, normalised
    make_tiny_embedding_model("llama_mean", path)   # mean pooling, not normalised
    make_tiny_embedding_model("llama_cls", path)    # LlamaForSequenceClassification (reward, 1 label)
    make_tiny_embedding_model("qwen2_cls", path)    # Qwen2ForSequenceClassification (3 labels)
    make_tiny_embedding_model("bert", path)         # BertModel, CLS pooling, normalised
    make_tiny_embedding_model("bert_cls", path)     # BertForSequenceClassification (cross-encoder)
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
}
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
EMBEDDING_KINDS = tuple(_ARCHITECTURES)
RERANKER_VOCAB = TINY_VOCAB + 2  # the tokenizer's "yes" and "no" come after the BPE vocabulary


def make_tiny_embedding_model(kind: str, path: str | Path, seed: int = 0) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind in ("bert", "bert_cls"):
        config = _bert_config(kind)
    else:
        config = _decoder_config(kind)
    cls = _auto_class(kind)
    model = cls(config) if kind in ("bert", "bert_cls") else cls.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    _fix_architecture(path, kind)
    _write_tokenizer(path, kind)
    _write_sentence_transformers(path, kind)
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


def _bert_config(kind: str) -> Any:  # noqa: ANN401
    from transformers import BertConfig

    extra = {"num_labels": 1} if kind == "bert_cls" else {}
    return BertConfig(architectures=[_ARCHITECTURES[kind]], **_BERT, **extra)


def _auto_class(kind: str) -> Any:  # noqa: ANN401
    import transformers

    if kind == "bert":
        return transformers.BertModel
    if kind == "bert_cls":
        return transformers.BertForSequenceClassification
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
    if kind in ("bert", "bert_cls"):
        _add_pair_template(path)
    elif kind == "qwen3_reranker":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        tok.add_tokens(["yes", "no"])  # single tokens, as in Qwen3's vocabulary
        tok.save_pretrained(str(path))


def _add_pair_template(path: Path) -> None:
    """BERT-style inputs: "<cls> A <sep>" and, for pairs, "B <sep>" with token type 1."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    backend = tok.backend_tokenizer
    cls_id, sep_id = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>",
        pair="<|im_start|> $A <|im_end|> $B:1 <|im_end|>:1",
        special_tokens=[("<|im_start|>", cls_id), ("<|im_end|>", sep_id)],
    )
    tok.save_pretrained(str(path))


def _write_sentence_transformers(path: Path, kind: str) -> None:
    if kind in ("bert",):
        mode, normalize = "cls_token", True
    elif kind in _DECODERS and _DECODERS[kind][2] is not None:
        mode, normalize = _DECODERS[kind][2], _DECODERS[kind][3]
    else:
        return
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
        "word_embedding_dimension": 64,
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
