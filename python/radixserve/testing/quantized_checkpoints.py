"""Pre-quantized HF checkpoints for tests: a tiny fp32 checkpoint quantized and stored the way
GPTQ (AutoGPTQ / GPTQModel), AWQ (AutoAWQ "gemm") and compressed-tensors (W8A8 int8) store theirs.
A MoE checkpoint gets its routed experts (`experts.{e}.{gate,up,down}_proj`, Mixtral's
`experts.{e}.w1/w2/w3`) and shared expert quantized too, its routers left as they are and listed in
`ignore`, as llm-compressor's W8A8 recipes for Qwen3-MoE and Mixtral do.

Written from the formats' descriptions, independently of radixserve's reader
(model_loader/quantized_hf.py): this side packs, that side unpacks. Each call also writes the
fp32 checkpoint the quantized one means (every quantized linear replaced by its dequantization,
scale * (q - zero) in fp32), the reference a loader and a served model are compared against.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# Decoder linears (HF names): attention, dense MLPs, shared experts and routed experts.
# Embeddings, norms, biases, the routers and the LM head stay as they are.
_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.)?(gate|up|down)_proj"
    r"|(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$"
)
# The routers, which llm-compressor's MoE recipes leave unquantized (compressed-tensors regexes).
MOE_IGNORE = ("re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8c + _AWQ_ORDER[i]
METHODS = ("gptq", "gptq_v2", "awq", "w8a8")


def quantize_int4(w: torch.Tensor, group: int, zero_min: int = 0) -> tuple[torch.Tensor, ...]:
    """Asymmetric int4 per group of `group` inputs: (q [N, K], zeros [N, K/G], fp16 scales
    [N, K/G]); q and zeros in 0..15 (zeros at least `zero_min`), scale = (max - min) / 15 in fp16."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0.0), g.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp(min=1e-4).to(torch.float16)
    s = scale.float()
    zeros = torch.round(-lo / s).clamp(zero_min, 15).to(torch.int32)
    q = (torch.round(g / s.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), zeros, scale


def dequantize_int4(q: torch.Tensor, zeros: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The formats' dequantization in fp32: scale * (q - zero)."""
    scales, zero_points = scale.float().repeat_interleave(group, 1), zeros.repeat_interleave(group, 1)
    return scales * (q - zero_points).float()


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...]: value i in bits 4i..4i+3 (two's complement)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (nibbles.to(torch.int64) << shifts).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_gptq(
    q: torch.Tensor, zeros: torch.Tensor, scale: torch.Tensor, stored_zero_delta: int
) -> dict[str, Any]:
    """GPTQ: qweight [K/8, N] (inputs 8i..8i+7 of output n in word [i, n]), qzeros [K/G, N/8]
    (outputs 8c..8c+7 of group g in word [g, c]), scales [K/G, N], g_idx [K]."""
    n, k = q.shape
    group = k // zeros.shape[1]
    stored = (zeros + stored_zero_delta) & 0xF  # v1 stores zero - 1
    return {
        "qweight": _words(q.T.reshape(k // 8, 8, n).transpose(1, 2)),
        "qzeros": _words(stored.T.reshape(-1, n // 8, 8)),
        "scales": scale.T.contiguous(),
        "g_idx": (torch.arange(k) // group).to(torch.int32),
    }


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scale: torch.Tensor) -> dict[str, Any]:
    """AWQ gemm: qweight [K, N/8] and qzeros [K/G, N/8], word [row, c] holding output
    8c + _AWQ_ORDER[i] in nibble i; scales [K/G, N]."""
    order = list(_AWQ_ORDER)

    def pack(t: torch.Tensor) -> torch.Tensor:  # [rows, N] -> [rows, N/8]
        return _words(t.reshape(t.shape[0], -1, 8)[..., order])

    return {"qweight": pack(q.T), "qzeros": pack(zeros.T), "scales": scale.T.contiguous()}


def quantize_w8a8(w: torch.Tensor, clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors W8A8: int8 [N, K] in [-128, 127] and an fp16 scale [N, 1] per output
    channel. clip 1.0 is the min-max observer (each row's largest |q| is 127); below 1, the range a
    clipping observer (llm-compressor's "mse") picks: the extremes clamp, to -128 on the negative
    side, so requantizing the dequantized row would not give the same integers back."""
    scale = (w.abs().amax(1, keepdim=True) * clip / 127).to(torch.float16)
    q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantization_config(method: str, group: int) -> dict[str, Any]:
    if method in ("gptq", "gptq_v2"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": False,
            "checkpoint_format": method,
        }
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", *MOE_IGNORE],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False, "observer": "minmax"},
                "input_activations": {**int8, "strategy": "token", "dynamic": True, "observer": None},
            }
        },
    }


def write_quantized_checkpoint(
    src: str | Path, dst: str | Path, ref: str | Path, method: str, group: int = 32, clip: float = 1.0
) -> dict[str, torch.Tensor]:
    """Quantize the decoder linears of the fp32 checkpoint `src` with `method` (METHODS) into an
    HF folder `dst`, and write their dequantization as the fp32 checkpoint `ref`. Returns the
    reference fp32 weight of every quantized linear by HF name. `clip`: quantize_w8a8's (w8a8)."""
    src, dst, ref = Path(src), Path(dst), Path(ref)
    tensors = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not _LINEAR.match(name):
            quantized[name] = reference[name] = w
            continue
        prefix = name.removesuffix(".weight")
        if method == "w8a8":
            q8, scale8 = quantize_w8a8(w, clip)
            quantized[name], quantized[prefix + ".weight_scale"] = q8, scale8
            reference[name] = q8.float() * scale8.float()
            continue
        g = w.shape[1] if group == -1 else group  # -1: one group per output channel
        q, zeros, scale = quantize_int4(w.float(), g, zero_min=1 if method == "gptq" else 0)
        packed = (
            pack_awq(q, zeros, scale)
            if method == "awq"
            else pack_gptq(q, zeros, scale, -1 if method == "gptq" else 0)
        )
        quantized.update({f"{prefix}.{k}": v for k, v in packed.items()})
        reference[name] = dequantize_int4(q, zeros, scale, g)
    for folder, weights in ((dst, quantized), (ref, reference)):
        shutil.copytree(src, folder, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, group)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return {k: v for k, v in reference.items() if _LINEAR.match(k)}
