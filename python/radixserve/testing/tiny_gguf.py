"""Tiny llama-architecture GGUF files for tests: random weights in chosen GGUF types, a small
byte-level BPE tokenizer, written with gguf-py's GGUFWriter (what llama.cpp's converters use).

Q8_0 / Q4_0 / Q4_1 tensors are quantized from random fp32 weights by gguf-py's own quantizer; the
K-quants, which gguf-py cannot quantize, are random blocks (random integer fields, random fp16
scales of a realistic size), so every integer and scale pattern occurs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.testing.tiny_models import CHATML_TEMPLATE, write_tiny_tokenizer

TINY_GGUF_CONFIG = {
    "hidden": 256,  # a multiple of 256: the K-quants' super-blocks
    "intermediate": 512,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "context": 1024,
}
# Every served type in one file, Q4_K_M-like mixes included (Q4_K q/k with a Q6_K v in one fused qkv).
MIXED_TYPES = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q6_K",
    "output": "Q4_K",
}
# fp16 fields of each K-quant block (byte offset -> typical magnitude), the rest being integers.
_K_QUANT_FP16 = {"Q4_K": {0: 4e-4, 2: 3e-4}, "Q6_K": {208: 1.5e-4}, "Q5_K": {0: 2e-4, 2: 2e-4}}
_FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208], "Q5_K": [0, 2]}


def random_gguf_blocks(
    kind: str, rows: int, cols: int, rng: np.random.Generator, magnitude: float = 0.05
) -> np.ndarray:
    """[rows, bytes per row] of random blocks of GGUF type `kind`: random integer fields, random
    finite fp16 scales (of both signs for the plain types, where gguf-py's quantizer makes both)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    nb = cols // block_size
    blocks = rng.integers(0, 256, size=(rows, nb, type_size), dtype=np.uint8)
    for start in _FP16_FIELDS[kind]:
        size = _K_QUANT_FP16.get(kind, {}).get(start, magnitude)
        values = rng.standard_normal((rows, nb)) * size
        if kind in _K_QUANT_FP16:
            values = np.abs(values)  # llama.cpp's K-quant super-block scales are non-negative
        blocks[..., start : start + 2] = (
            values.astype(np.float16)[..., None].view(np.uint8).reshape(rows, nb, 2)
        )
    return blocks.reshape(rows, -1)


def _tensor_bytes(kind: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[kind]
    if kind in _K_QUANT_FP16:
        return random_gguf_blocks(kind, rows, cols, rng), qtype
    weights = (rng.standard_normal((rows, cols)) * 0.25).astype(np.float32)
    if kind == "F32":
        return weights, None
    if kind == "F16":
        return weights.astype(np.float16), None
    return quantize(weights, qtype), qtype


def _tokenizer_fields() -> tuple[list[str], list[str], list[int]]:
    """tokens, merges and token types of the tiny BPE tokenizer of tiny_models."""
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_tokenizer(tmp)
        model = json.loads((Path(tmp) / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if i < 3 else 1 for i in range(len(tokens))]  # ids 0..2: control (special) tokens
    return tokens, merges, types


def add_tokenizer(writer: Any, tokens: list[str], merges: list[str], token_types: list[int]) -> None:  # noqa: ANN401
    """The tiny BPE tokenizer's fields, its special ids and the ChatML template."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_gguf(writer: Any, path: Path) -> Path:  # noqa: ANN401 - a gguf.GGUFWriter
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_tiny_gguf(
    path: str | Path, types: dict[str, str] | None = None, seed: int = 0, tied: bool = True
) -> Path:
    """Write a tiny llama GGUF to `path` (a file). `types` maps GGUF tensor kinds ("attn_q", ...,
    "token_embd", "output") to GGUF type names (MIXED_TYPES by default); norms are F32. With
    `tied` the file has no output.weight (the LM head is token_embd, as in the built-in model)."""
    import gguf

    types = {**MIXED_TYPES, **(types or {})}
    cfg = TINY_GGUF_CONFIG
    hidden, inter, head_dim = cfg["hidden"], cfg["intermediate"], cfg["hidden"] // cfg["heads"]
    tokens, merges, token_types = _tokenizer_fields()
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg["layers"])
    writer.add_context_length(cfg["context"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    add_tokenizer(writer, tokens, merges, token_types)
    kv = cfg["kv_heads"] * head_dim
    shapes = {  # [out, in]
        "attn_q": (hidden, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        data, raw_dtype = _tensor_bytes(kind, rows, cols, rng)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)

    add("token_embd.weight", types["token_embd"], len(tokens), hidden)
    for i in range(cfg["layers"]):
        for kind, (rows, cols) in shapes.items():
            add(f"blk.{i}.{kind}.weight", types[kind], rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    if not tied:
        add("output.weight", types["output"], len(tokens), hidden)
    return write_gguf(writer, path)
