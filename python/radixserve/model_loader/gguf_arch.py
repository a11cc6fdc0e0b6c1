"""The llama.cpp architectures a GGUF file converts from, one table each: which HF architecture it
becomes, its tensor names, its config keys (facts from llama.cpp's src/models/*.cpp and gguf-py's
constants).

| GGUF `general.architecture` | HF architecture | Q/K rows permuted | routed experts |
|---|---|---|---|
| llama (no expert_count) | LlamaForCausalLM | yes | - |
| llama with `llama.expert_count` | MixtralForCausalLM | yes | top-k renormalised |
| qwen2moe | Qwen2MoeForCausalLM | no (NEOX rope) | not renormalised, shared expert + gate |
| qwen3moe | Qwen3MoeForCausalLM | no (NEOX rope) | renormalised, q/k norm |

llama.cpp's graphs fix the renormalisation per architecture (build_moe_ffn's norm_w: true for
llama and qwen3moe, false for qwen2moe), so the HF config says the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from radixserve.model_loader.errors import ModelLoadError


@dataclass(frozen=True)
class GgufArch:
    gguf_name: str  # general.architecture
    hf_architecture: str
    model_type: str
    rope_permuted: bool  # llama.cpp's converter interleaved each head's Q/K rows
    moe_module: str  # the HF module holding the router and experts
    expert_projs: tuple[str, str, str]  # HF names of one expert's gate, up, down projections
    renormalize: bool  # top-k weights rescaled to sum to 1 (HF's norm_topk_prob)
    # The HF config key saying the file's q/k/v biases exist (Llama's also adds an o_proj bias).
    qkv_bias_key: str = "attention_bias"


LLAMA = GgufArch(
    "llama", "LlamaForCausalLM", "llama", True, "mlp", ("gate_proj", "up_proj", "down_proj"), False
)
MIXTRAL = GgufArch(
    "llama", "MixtralForCausalLM", "mixtral", True, "block_sparse_moe", ("w1", "w3", "w2"), True
)
QWEN2MOE = GgufArch(
    "qwen2moe",
    "Qwen2MoeForCausalLM",
    "qwen2_moe",
    False,
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    False,
    qkv_bias_key="qkv_bias",
)
QWEN3MOE = GgufArch(
    "qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", False, "mlp", ("gate_proj", "up_proj", "down_proj"), True
)
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2moe", "qwen3moe")

# GGUF per-layer tensor names -> HF module names (the MoE router's module depends on the arch).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# The stacked expert tensors: [num_experts, rows, cols] in torch's order, one slice per expert.
EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def resolve_arch(meta: dict[str, Any]) -> GgufArch:
    arch = meta.get("general.architecture")
    if arch == "llama":
        return MIXTRAL if int(meta.get("llama.expert_count", 0) or 0) > 0 else LLAMA
    if arch == "qwen2moe":
        return QWEN2MOE
    if arch == "qwen3moe":
        return QWEN3MOE
    raise ModelLoadError(
        f"GGUF conversion supports the architectures {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}, got {arch!r}."
    )


def hf_tensor_name(gguf_name: str, arch: GgufArch = LLAMA) -> str:
    """GGUF tensor name -> HF parameter name (not the stacked expert tensors: expert_tensor_names)."""
    if m := _LAYER_RE.match(gguf_name):
        layer, kind, suffix = m.groups()
        if kind == "ffn_gate_inp":
            return f"model.layers.{layer}.{arch.moe_module}.gate.{suffix}"
        if kind in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    elif (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(
        f"GGUF tensor {gguf_name!r} has no HF {arch.hf_architecture} equivalent; cannot convert this file."
    )


def expert_tensor_names(gguf_name: str, arch: GgufArch, num_experts: int) -> list[str] | None:
    """The HF per-expert names of a stacked `blk.N.ffn_*_exps.weight` (expert e's slice -> entry e),
    or None for any other tensor."""
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in EXPERT_KINDS or m.group(3) != "weight":
        return None
    proj = arch.expert_projs[EXPERT_KINDS.index(m.group(2))]
    prefix = f"model.layers.{m.group(1)}.{arch.moe_module}.experts"
    return [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts)]


def moe_config(arch: GgufArch, meta: dict[str, Any], dense_layers: list[int]) -> dict[str, Any]:
    """The HF config keys of the routed experts (empty for a dense llama)."""
    if arch is LLAMA:
        return {}
    prefix = arch.gguf_name

    def get(key: str) -> int:
        if f"{prefix}.{key}" not in meta:
            raise ModelLoadError(f"GGUF metadata lacks {prefix}.{key}; cannot build config.json.")
        return int(meta[f"{prefix}.{key}"])

    num_experts, top_k = get("expert_count"), get("expert_used_count")
    if arch is MIXTRAL:
        # Mixtral's experts are `intermediate_size` wide (llama.cpp writes feed_forward_length).
        return {"num_local_experts": num_experts, "num_experts_per_tok": top_k, "sliding_window": None}
    config: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "norm_topk_prob": arch.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense_layers,  # llama.cpp's graphs have none; a file may still hold them
    }
    if arch is QWEN2MOE:
        config["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
    return config
