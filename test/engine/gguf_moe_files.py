"""The tiny GGUF MoE files of the engine tests (test_gguf_moe.py, test_gguf_moe_load.py): each
variant's file is written once per module by the `moe_gguf` fixture (conftest.py), and its
dequantized HF twin by `hf_twin`."""

from __future__ import annotations

# (tiny kind, file type of the weight matrices, per-tensor types, HF config overrides): Q8_0
# everywhere, Mixtral's experts in 4 bits (gate/up Q4_0, down Q4_1) beside Q8_0 attention, and a
# Qwen2-MoE whose layer 1 is dense (a file may hold one; llama.cpp's graph would not run it).
Q4_EXPERTS = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q4_1"}
VARIANTS = {
    "qwen2_moe-q8_0": ("qwen2_moe", "Q8_0", {}, {}),
    "qwen3_moe-q8_0": ("qwen3_moe", "Q8_0", {}, {}),
    "mixtral-q8_0": ("mixtral", "Q8_0", {}, {}),
    "mixtral-q4": ("mixtral", "Q8_0", Q4_EXPERTS, {}),
    "qwen2_moe-dense-layer": ("qwen2_moe", "Q4_1", {}, {"mlp_only_layers": [1]}),
    # Experts in a plain type: they serve in fp32 under --quantization gguf too, read from the file.
    "qwen3_moe-f16-experts": ("qwen3_moe", "Q8_0", dict.fromkeys(Q4_EXPERTS, "F16"), {}),
}
QUANTIZED_EXPERTS = [v for v in VARIANTS if v != "qwen3_moe-f16-experts"]
