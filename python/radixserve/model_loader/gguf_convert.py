"""Convert a GGUF file (llama, Mixtral, Qwen2-MoE, Qwen3-MoE: model_loader/gguf_arch.py) into an
HF-format folder transformers can load.

Output: config.json, generation_config.json, model.safetensors (fp32, dequantized),
tokenizer.json (built with `tokenizers` from the GGUF BPE vocab/merges) and tokenizer_config.json
(special tokens and chat template). Used for the built-in SmolLM2 model, whose only offline source
is a Q4_1 GGUF, and for `--model-path model.gguf`. llama.cpp's stacked expert tensors
(`blk.N.ffn_*_exps.weight`, [num_experts, rows, cols]) are left out: radixserve's loader reads
them from the file (model_loader/gguf_experts.py). With `include_experts` they become HF's one
tensor per expert, a folder transformers loads whole (the tests' dequantized HF twin).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_arch import (
    GgufArch,
    expert_tensor_names,
    hf_tensor_name,
    moe_config,
    resolve_arch,
)

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType): which vocab entries are special/added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# GGUF `tokenizer.ggml.pre` values we can express with HF pre-tokenizers. Getting this wrong would
# silently change token ids, so anything else is refused.
_SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt-2", "default", "qwen2")
# Qwen2's split (its tokenizer.json's Split pre-tokenizer, "Isolated"), before a regex-free ByteLevel.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class GgufHParams:
    arch: GgufArch
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_len: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False  # the file has q/k/v biases (Qwen2-MoE)
    moe: tuple[tuple[str, Any], ...] = ()  # the HF config keys of the experts (gguf_arch.moe_config)

    @property
    def num_experts(self) -> int:
        moe = dict(self.moe)
        return int(moe.get("num_experts") or moe.get("num_local_experts") or 0)


def convert_gguf_to_hf(
    gguf_path: str,
    out_dir: str,
    show_progress: bool = True,
    default_chat_template: str | None = None,
    include_experts: bool = False,
) -> None:
    """Write an HF-format folder for `gguf_path` into the existing directory `out_dir`.

    `default_chat_template` is used only when the GGUF carries no tokenizer.chat_template;
    `include_experts` writes the routed experts too (in fp32: ~8x their bytes in a Q4 file).
    """
    from gguf import GGUFReader  # the gguf package is only needed at conversion time

    try:
        reader = GGUFReader(gguf_path)
    except Exception as exc:  # GGUFReader raises ValueError/struct errors on a bad file
        raise ModelLoadError(f"Cannot read GGUF file {gguf_path}: {exc}") from exc
    meta = read_metadata(reader)
    hparams = read_hparams(meta, {t.name for t in reader.tensors})
    special = _special_token_ids(meta)
    _write_json(os.path.join(out_dir, "config.json"), hf_config_dict(hparams, special))
    _write_json(os.path.join(out_dir, "generation_config.json"), _generation_config(special))
    path = os.path.join(out_dir, "model.safetensors")
    _write_weights(reader, hparams, path, show_progress, include_experts)
    write_tokenizer(meta, special, hparams.context_len, out_dir, default_chat_template)


def read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def read_hparams(meta: dict[str, Any], tensor_names: set[str]) -> GgufHParams:
    """The model's hyper-parameters from `<arch>.*` metadata; biases, tying and dense layers are
    read off which tensors the file holds."""
    arch = resolve_arch(meta)
    prefix = arch.gguf_name
    if f"{prefix}.rope.scaling.type" in meta:
        raise ModelLoadError("GGUF files with rope scaling are not supported by the converter.")

    def get(key: str) -> Any:
        if f"{prefix}.{key}" not in meta:
            raise ModelLoadError(f"GGUF metadata lacks {prefix}.{key}; cannot build config.json.")
        return meta[f"{prefix}.{key}"]

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    num_layers = int(get("block_count"))
    vocab = meta.get(f"{prefix}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensor_names]
    moe = moe_config(arch, meta, dense)
    # Qwen3-MoE files may omit feed_forward_length (no dense MLP); HF wants a value.
    inter = meta.get(f"{prefix}.feed_forward_length") or moe.get("moe_intermediate_size")
    if inter is None:
        raise ModelLoadError(f"GGUF metadata lacks {prefix}.feed_forward_length; cannot build config.json.")
    return GgufHParams(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(inter),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{prefix}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{prefix}.attention.key_length", hidden // heads)),
        vocab_size=int(vocab),
        context_len=int(get("context_length")),
        rope_theta=float(meta.get(f"{prefix}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        moe=tuple(moe.items()),
    )


def hf_config_dict(hp: GgufHParams, special: dict[str, int | None]) -> dict[str, Any]:
    # float32 rounding in GGUF turns 1e-5 into 9.9999997e-06; store the value the model was trained with.
    eps = float(f"{hp.rms_norm_eps:.6g}")
    return {
        "architectures": [hp.arch.hf_architecture],
        "model_type": hp.arch.model_type,
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_layers,
        "num_attention_heads": hp.num_heads,
        "num_key_value_heads": hp.num_kv_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hp.context_len,
        "rms_norm_eps": eps,
        # Both spellings: transformers >= 5 reads rope_parameters, 4.x and other readers rope_theta.
        "rope_theta": hp.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": hp.rope_theta},
        "vocab_size": hp.vocab_size,
        "tie_word_embeddings": hp.tie_word_embeddings,
        "attention_bias": False,
        hp.arch.qkv_bias_key: hp.attention_bias,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": special["bos"],
        "eos_token_id": special["eos"],
        "pad_token_id": special["pad"],
        "dtype": "float32",  # transformers >= 4.56 name; older versions default to fp32 anyway
        "use_cache": True,
        **dict(hp.moe),
    }


def _generation_config(special: dict[str, int | None]) -> dict[str, Any]:
    return {"bos_token_id": special["bos"], "eos_token_id": special["eos"], "pad_token_id": special["pad"]}


def _special_token_ids(meta: dict[str, Any]) -> dict[str, int | None]:
    def get(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if value is None else int(value)

    return {"bos": get("bos"), "eos": get("eos"), "pad": get("padding"), "unk": get("unknown")}


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def undo_rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation.

    HF Llama applies rotary embedding to the two halves of each head (rotate_half); llama.cpp
    rotates adjacent pairs, so its converter interleaves each head's rows: GGUF row 2*i + j of a
    head is HF row j * head_dim/2 + i. Reading the rows as [head, i, j] and swapping i/j undoes it.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return np.ascontiguousarray(
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUF tensor as fp32 in torch's dimension order (GGUF lists dims fastest-first)."""
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    torch_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return array.reshape(torch_shape)


def hf_tensors(tensor: Any, hp: GgufHParams) -> dict[str, np.ndarray]:
    """One GGUF tensor as the HF tensors it becomes (several for a stacked expert tensor)."""
    array = dequantize_tensor(tensor)
    experts = expert_tensor_names(tensor.name, hp.arch, hp.num_experts)
    if experts is not None:
        if array.shape[0] != len(experts):
            raise ModelLoadError(
                f"GGUF tensor {tensor.name} holds {array.shape[0]} experts, expected {len(experts)}"
            )
        return {name: np.ascontiguousarray(array[e]) for e, name in enumerate(experts)}
    name = hf_tensor_name(tensor.name, hp.arch)
    if hp.arch.rope_permuted and ".self_attn.q_proj." in name:
        array = undo_rope_permute(array, hp.num_heads)
    elif hp.arch.rope_permuted and ".self_attn.k_proj." in name:
        array = undo_rope_permute(array, hp.num_kv_heads)
    elif name.endswith(".shared_expert_gate.weight"):
        array = array.reshape(1, -1)  # llama.cpp stores the [1, hidden] gate as a vector
    return {name: array}


def _write_weights(
    reader: Any, hp: GgufHParams, path: str, show_progress: bool, include_experts: bool
) -> None:
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(
        reader.tensors, desc="Converting GGUF tensors", unit="tensor", disable=not show_progress
    ):
        if include_experts or expert_tensor_names(tensor.name, hp.arch, hp.num_experts) is None:
            tensors.update(hf_tensors(tensor, hp))
    expected_embed = (hp.vocab_size, hp.hidden_size)
    got_embed = tensors.get("model.embed_tokens.weight", np.empty(0)).shape
    if got_embed != expected_embed:
        raise ModelLoadError(f"GGUF token_embd has shape {got_embed}, expected {expected_embed}.")
    # transformers refuses safetensors files without a "format" entry.
    save_file(tensors, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def build_hf_tokenizer(meta: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's byte-level BPE tokenizer."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError(
            f"Only GGUF byte-level BPE ('gpt2') tokenizers convert, got {meta.get('tokenizer.ggml.model')!r}."
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _SUPPORTED_PRE_TOKENIZERS:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {_SUPPORTED_PRE_TOKENIZERS})."
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM splits every digit into its own pre-token before the GPT-2 regex.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "qwen2":
        # Qwen2's tokenizer.json: NFC, its own split (single digits, case-insensitive
        # contractions), then ByteLevel without the GPT-2 regex.
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = list(meta.get("tokenizer.ggml.token_type", []))
    added = [
        AddedToken(tokens[i], special=t == _TOKEN_TYPE_CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    return tokenizer


def write_tokenizer(
    meta: dict[str, Any],
    special: dict[str, int | None],
    context_len: int,
    out_dir: str,
    default_chat_template: str | None = None,
) -> None:
    tokenizer = build_hf_tokenizer(meta)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", []))

    def token(key: str) -> str | None:
        return tokens[special[key]] if special[key] is not None else None

    control = [tokens[i] for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL]
    config: dict[str, Any] = {
        # The generic fast tokenizer loads tokenizer.json verbatim on transformers 4.x and 5.x.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("pad"),
        "unk_token": token("unk"),
        "additional_special_tokens": [t for t in control if t in ("<|im_start|>", "<|im_end|>")],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_len,
    }
    chat_template = meta.get("tokenizer.chat_template") or default_chat_template
    if chat_template:
        config["chat_template"] = chat_template
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
