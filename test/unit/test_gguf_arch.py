"""GGUF MoE conversion tables (model_loader/gguf_arch.py) and the qwen2 pre-tokenizer: names,
config keys and tokenization against references built independently of the converter."""

from __future__ import annotations

import json

import pytest

from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_arch import (
    LLAMA,
    MIXTRAL,
    QWEN2MOE,
    QWEN3MOE,
    expert_tensor_names,
    hf_tensor_name,
    moe_config,
    resolve_arch,
)
from radixserve.model_loader.gguf_convert import build_hf_tokenizer
from radixserve.testing.tiny_gguf import _tokenizer_fields

pytest.importorskip("gguf")


def test_architectures_resolve_from_metadata():
    assert resolve_arch({"general.architecture": "llama"}) is LLAMA
    assert resolve_arch({"general.architecture": "llama", "llama.expert_count": 8}) is MIXTRAL
    assert resolve_arch({"general.architecture": "qwen2moe"}) is QWEN2MOE
    assert resolve_arch({"general.architecture": "qwen3moe"}) is QWEN3MOE
    with pytest.raises(ModelLoadError, match="'deepseek2'"):
        resolve_arch({"general.architecture": "deepseek2"})
    # llama.cpp's rope conventions: llama-style rope interleaves Q/K rows, Qwen's NEOX rope does not.
    assert LLAMA.rope_permuted and MIXTRAL.rope_permuted
    assert not QWEN2MOE.rope_permuted and not QWEN3MOE.rope_permuted


def test_moe_tensor_names_follow_each_architecture():
    assert (
        hf_tensor_name("blk.3.ffn_gate_inp.weight", MIXTRAL) == "model.layers.3.block_sparse_moe.gate.weight"
    )
    assert hf_tensor_name("blk.3.ffn_gate_inp.weight", QWEN3MOE) == "model.layers.3.mlp.gate.weight"
    assert hf_tensor_name("blk.0.attn_k_norm.weight", QWEN3MOE) == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.1.attn_q.bias", QWEN2MOE) == "model.layers.1.self_attn.q_proj.bias"
    assert (
        hf_tensor_name("blk.1.ffn_down_shexp.weight", QWEN2MOE)
        == "model.layers.1.mlp.shared_expert.down_proj.weight"
    )
    assert (
        hf_tensor_name("blk.1.ffn_gate_inp_shexp.weight", QWEN2MOE)
        == "model.layers.1.mlp.shared_expert_gate.weight"
    )
    assert expert_tensor_names("blk.2.ffn_up_exps.weight", MIXTRAL, 2) == [
        "model.layers.2.block_sparse_moe.experts.0.w3.weight",
        "model.layers.2.block_sparse_moe.experts.1.w3.weight",
    ]
    assert expert_tensor_names("blk.2.ffn_down_exps.weight", QWEN3MOE, 1) == [
        "model.layers.2.mlp.experts.0.down_proj.weight"
    ]
    assert expert_tensor_names("blk.2.ffn_down.weight", QWEN3MOE, 4) is None
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight", QWEN3MOE)  # experts are split, never renamed


def test_moe_config_keys():
    meta = {
        "qwen2moe.expert_count": 60,
        "qwen2moe.expert_used_count": 4,
        "qwen2moe.expert_feed_forward_length": 1408,
        "qwen2moe.expert_shared_feed_forward_length": 5632,
    }
    config = moe_config(QWEN2MOE, meta, [])
    assert config["num_experts"] == 60 and config["num_experts_per_tok"] == 4
    assert config["moe_intermediate_size"] == 1408 and config["shared_expert_intermediate_size"] == 5632
    assert config["norm_topk_prob"] is False  # llama.cpp's qwen2moe graph does not renormalise
    q3 = {
        "qwen3moe.expert_count": 128,
        "qwen3moe.expert_used_count": 8,
        "qwen3moe.expert_feed_forward_length": 768,
    }
    assert moe_config(QWEN3MOE, q3, [])["norm_topk_prob"] is True
    mixtral = moe_config(MIXTRAL, {"llama.expert_count": 8, "llama.expert_used_count": 2}, [])
    assert mixtral["num_local_experts"] == 8 and mixtral["num_experts_per_tok"] == 2
    with pytest.raises(ModelLoadError, match="qwen3moe.expert_used_count"):
        moe_config(QWEN3MOE, {"qwen3moe.expert_count": 8}, [])


# Qwen2's pre-tokenizer and normalizer exactly as its tokenizer.json writes them.
QWEN2_TOKENIZER_JSON_PARTS = json.loads(
    r"""{"normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
  {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
   "behavior": "Isolated", "invert": false},
  {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]}}"""
)
TEXTS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "It's 12345 o'clock; WE'LL see   you\n\n  at 3.14 PM!!",
    "Héllo 日本語 😀 STOP here. def f(x): return x * 2\r\n\tend",
    "e\u0301 composed vs \u00e9",  # NFC folds the combining accent
]


def test_qwen2_pre_tokenizer_tokenizes_like_qwen2s_tokenizer_json():
    from tokenizers import Tokenizer

    tokens, merges, types = _tokenizer_fields()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
    }
    ours = build_hf_tokenizer(meta)
    # The reference: the same vocab/merges with Qwen2's normalizer and pre-tokenizer, from JSON.
    spec = json.loads(ours.to_str())
    spec.update(QWEN2_TOKENIZER_JSON_PARTS)
    reference = Tokenizer.from_str(json.dumps(spec))
    default = build_hf_tokenizer({**meta, "tokenizer.ggml.pre": "default"})
    differs = False
    for text in TEXTS:
        assert ours.encode(text).ids == reference.encode(text).ids, text
        differs |= default.encode(text).ids != reference.encode(text).ids
    assert differs  # the texts tell Qwen2's split from GPT-2's (single digits, "WE'LL")
