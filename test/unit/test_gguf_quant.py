"""GGUF quantized tensors as GroupQuantWeights: bit-faithful to gguf-py's reference dequantization
for every served type, and a type it cannot serve is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from radixserve.layers.group_quant_ops import concat_rows, pad_rows, take_inputs, take_rows
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_quant import GGUF_WQ_TYPES, check_tensor_types, decode_quantized
from radixserve.testing.tiny_gguf import random_gguf_blocks


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return random_gguf_blocks(kind, rows, cols, np.random.default_rng(seed))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("kind", GGUF_WQ_TYPES)
def test_dequantize_is_gguf_reference_bit_for_bit(kind: str) -> None:
    rows, cols = 24, 512
    raw = random_blocks(kind, rows, cols)
    w = decode_quantized(raw, kind, rows, cols)
    ref = dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols)
    got = w.dequantize().numpy()
    assert w.out_features == rows and w.in_features == cols
    if kind == "Q4_0":
        # d*(q-8) is -0.0 for q == 8 and d < 0, q*d + (-8*d) is +0.0: equal values, one sign bit.
        assert np.array_equal(got, ref)
        assert np.array_equal(_bits(got + np.float32(0)), _bits(ref + np.float32(0)))
    else:
        assert np.array_equal(_bits(got), _bits(ref))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_from_gguf_quantizer_round_trip(kind: str) -> None:
    # Blocks made by gguf-py's own quantizer (the path llama.cpp files take), not random bytes.
    weights = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    raw = quantize(weights, GGMLQuantizationType[kind])
    w = decode_quantized(raw, kind, 16, 256)
    ref = dequantize(raw, GGMLQuantizationType[kind])
    assert np.array_equal(w.dequantize().numpy(), ref)
    assert np.abs(ref - weights).max() < 0.5  # a quantization of the weights, not noise


def test_unsupported_type_is_refused_naming_type_and_tensor() -> None:
    class Tensor:
        name = "blk.3.ffn_down.weight"
        tensor_type = GGMLQuantizationType.Q5_K

    with pytest.raises(ModelLoadError, match=r"'blk\.3\.ffn_down\.weight' has type Q5_K"):
        check_tensor_types([Tensor()])


def test_shard_and_fuse_keep_the_values() -> None:
    a = decode_quantized(random_blocks("Q4_K", 8, 256, seed=2), "Q4_K", 8, 256)
    b = decode_quantized(random_blocks("Q6_K", 4, 256, seed=3), "Q6_K", 4, 256)
    fused = concat_rows([a, b])  # a Q4_K_M-style qkv: Q4_K rows then Q6_K rows
    assert (fused.bits, fused.group_size) == (8, 16)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    part = take_inputs(a, 64, 128, "x")
    assert torch.equal(part.dequantize(), a.dequantize()[:, 64:192])
    assert torch.equal(take_rows(a, slice(2, 5)).dequantize(), a.dequantize()[2:5])
    padded = pad_rows(a, 11)
    assert torch.equal(padded.dequantize()[:8], a.dequantize()) and not padded.dequantize()[8:].any()
    with pytest.raises(ModelLoadError, match="split a quantization group"):
        take_inputs(a, 16, 128, "blk.0.ffn_down.weight")
