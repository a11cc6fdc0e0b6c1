"""Tiny mixture-of-experts GGUF files for tests, written the way llama.cpp's converter writes them
from a tiny random HF MoE checkpoint (testing/tiny_models.py): `qwen2moe` (shared expert and its
gate), `qwen3moe` (q/k norms), and Mixtral as `llama` with `llama.expert_count`. Experts are the
stacked `blk.N.ffn_{gate,up,down}_exps.weight` tensors; the routers, norms, biases and the shared
expert's gate stay F32 (llama-quantize leaves `ffn_gate_inp` unquantized too).

The HF checkpoint's sizes are bumped where a quantization block (32 inputs) would not divide them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.testing.tiny_gguf import _tokenizer_fields, add_tokenizer, write_gguf
from radixserve.testing.tiny_models import make_tiny_model

# tiny_models kind -> (GGUF architecture, HF config overrides making every input width a multiple of 32).
MOE_GGUF_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    # llama.cpp's qwen2moe graph has no dense layers: every layer sparse.
    "qwen2_moe": ("qwen2moe", {"shared_expert_intermediate_size": 64, "mlp_only_layers": []}),
    "qwen3_moe": ("qwen3moe", {}),
    "mixtral": ("llama", {"intermediate_size": 64}),
}
_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",  # a dense layer's MLP
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_EXPERT_PROJ = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
# Tensors llama.cpp keeps in F32 whatever the file's type.
_KEEP_F32 = ("_norm", "ffn_gate_inp", ".bias")


def rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row interleaving (gguf_convert.undo_rope_permute inverts it)."""
    rows = weight.shape[0]
    return np.ascontiguousarray(
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_tensors(state: dict[str, np.ndarray], config: Any, arch: str) -> dict[str, np.ndarray]:
    """HF tensors -> GGUF tensors (fp32), experts stacked [num_experts, rows, cols]."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, array in state.items():
        if name in _HF_TO_GGUF:
            out[_HF_TO_GGUF[name]] = array
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        if ".experts." in module:
            expert_id, proj_name = module.split(".experts.")[1].split(".")
            key = (layer, _EXPERT_PROJ[proj_name])
            experts.setdefault(key, {})[int(expert_id)] = array
            continue
        kind = _LAYER_HF_TO_GGUF[module]
        if arch == "llama" and kind in ("attn_q", "attn_k") and suffix == "weight":
            heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
            array = rope_permute(array, heads)
        if kind == "ffn_gate_inp_shexp":
            array = array.reshape(-1)
        out[f"blk.{layer}.{kind}.{suffix}"] = array
    for (layer, proj), by_id in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_id[e] for e in sorted(by_id)])
    return out


def _add_metadata(writer: Any, config: Any, arch: str, vocab: int) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(vocab)
    if arch == "llama":
        writer.add_expert_count(config.num_local_experts)
    else:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _encode(name: str, array: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    """(data, raw_dtype) of a tensor stored as GGUF type `kind` (F32 for norms, routers, biases)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    array = np.ascontiguousarray(array, dtype=np.float32)
    if kind == "F32" or array.ndim == 1 or any(k in name for k in _KEEP_F32):
        return array, None
    qtype = GGMLQuantizationType[kind]
    return quantize(array, qtype), qtype  # quantizes along the last (fastest) dim, any leading dims


def make_tiny_moe_gguf(
    path: str | Path,
    kind: str,
    qtype: str = "Q8_0",
    types: dict[str, str] | None = None,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write the tiny `kind` MoE (a MOE_GGUF_KINDS key) as a GGUF file at `path`: every weight
    matrix of type `qtype` (F32, Q8_0, Q4_0, Q4_1) unless `types` maps its GGUF kind
    ("ffn_down_exps", "attn_q", "token_embd", ...) to another. `overrides` update the HF config
    (e.g. Qwen2-MoE's `mlp_only_layers`: dense layers, which llama.cpp's own graph lacks)."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    arch, overrides_for_kind = MOE_GGUF_KINDS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(kind, tmp, seed=seed, overrides={**overrides_for_kind, **(overrides or {})})
        config = AutoConfig.from_pretrained(tmp)
        state = {k: v.to(torch.float32).numpy() for k, v in load_file(f"{tmp}/model.safetensors").items()}
    tokens, merges, token_types = _tokenizer_fields()
    # The checkpoint's vocabulary is larger than the tokenizer's: llama.cpp's converter pads it
    # with unused "[PAD<id>]" tokens.
    pads = config.vocab_size - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), config.vocab_size)]
    token_types += [5] * pads  # gguf.TokenType.UNUSED
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    _add_metadata(writer, config, arch, len(tokens))
    add_tokenizer(writer, tokens, merges, token_types)
    for name, array in _gguf_tensors(state, config, arch).items():
        tensor_kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        data, raw_dtype = _encode(name, array, (types or {}).get(tensor_kind, qtype))
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    return write_gguf(writer, path)
