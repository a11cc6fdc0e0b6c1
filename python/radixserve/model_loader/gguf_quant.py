"""GGUF quantized tensors as GroupQuantWeights: the file's own integers and scales, unpacked from
its blocks and never re-rounded (docs/quantization.md has the mapping).

| GGUF | bits | group | scale | offset |
|---|---|---|---|---|
| Q8_0 | 8 (q int8) | 32 | d | none |
| Q4_0 | 4 (q 0..15) | 32 | d | -8*d |
| Q4_1 | 4 | 32 | d | m |
| Q4_K | 4 | 32 (8 per 256 super-block) | d*sc | -(dmin*m) |
| Q6_K | 8 (q - 32, -32..31) | 16 (16 per super-block) | d*sc | none |

d, m, dmin are fp16 in the file, sc and m 6-bit (Q4_K) or int8 (Q6_K) integers: every scale and
offset above is exact in fp32, and gguf-py's reference dequantization computes the same product
and sum, so GroupQuantWeight.dequantize() gives its bits (Q4_0: up to the sign of zero, since
d*(q-8) is -0.0 where q*d + (-8*d) is +0.0). The unpacking below follows gguf-py's
dequantize_blocks index for index (gguf/quants.py), stopping before the multiplication.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.model_loader.errors import ModelLoadError

# Served as GroupQuantWeights.
GGUF_WQ_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# Served as plain fp32 (their values are fp32-exact).
GGUF_PLAIN_TYPES = ("F32", "F16", "BF16")


def check_tensor_types(tensors: list[Any]) -> None:
    """Refuse a file holding a tensor type --quantization gguf cannot serve, naming it."""
    supported = GGUF_WQ_TYPES + GGUF_PLAIN_TYPES
    for tensor in tensors:
        kind = tensor.tensor_type.name
        if kind not in supported:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has type {kind}, which --quantization gguf does not "
                f"serve (supported: {', '.join(supported)}); convert the file to one of them, or "
                "serve it dequantized to fp32 with --quantization unquant"
            )


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] -> fp32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, split: int) -> np.ndarray:
    """Bytes [..., n] -> 4-bit values: gguf's `reshape(.., split) >> [0, 4]` order (the low nibbles
    of `split` consecutive bytes, then their high nibbles), as uint8 [..., 2 n]."""
    lead = qs.shape[:-1]
    shifted = qs.reshape(*lead, -1, 1, split) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (shifted & np.uint8(0x0F)).reshape(*lead, -1)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    return np.ascontiguousarray(blocks[..., 2:]).view(np.int8), _f16(blocks[..., 0:2]), None, 32


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    d = _f16(blocks[..., 0:2])
    return _nibbles(blocks[..., 2:], 16), d, d * np.float32(-8.0), 32


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    return _nibbles(blocks[..., 4:], 16), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), 32


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    from gguf.quants import Q4_K

    rows, nb = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, nb]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scales = d[..., None] * sc.reshape(rows, nb, 8).astype(np.float32)
    offsets = -(dmin[..., None] * m.reshape(rows, nb, 8).astype(np.float32))
    # 128 bytes: sub-block 2j is the low nibbles of bytes 32j..32j+31, sub-block 2j+1 their high.
    return _nibbles(blocks[..., 16:], 32), scales, offsets, 32


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    rows, nb = blocks.shape[:2]
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scales = _f16(blocks[..., 208:210])[..., None] * sc  # [rows, nb, 16]
    low = _nibbles(ql, 64).reshape(rows, nb, 8, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    high = ((qh.reshape(rows, nb, 2, 1, 32) >> shifts) & np.uint8(0x03)).reshape(rows, nb, 8, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q, scales, None, 16


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q6_K": 8}


def decode_quantized(raw: np.ndarray, kind: str, rows: int, cols: int) -> GroupQuantWeight:
    """A GGUF tensor's bytes ([rows, bytes per row] uint8) of type `kind` (a GGUF_WQ_TYPES name)
    as a GroupQuantWeight [rows, cols]."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // block_size, type_size)
    q, scales, offsets, group_size = _DECODERS[kind](blocks)
    q_t = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols))
    bits = _BITS[kind]
    qweight = q_t.to(torch.int8) if bits == 8 else pack_int4(q_t)
    groups = cols // group_size
    scales_t = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, groups))
    offsets_t = (
        None
        if offsets is None
        else torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32).reshape(rows, groups))
    )
    return GroupQuantWeight(qweight.contiguous(), scales_t, offsets_t, group_size, bits)


def tensor_group_quant(tensor: Any) -> GroupQuantWeight | None:
    """A 2-D GGUF tensor (gguf's ReaderTensor) as a GroupQuantWeight [out, in] in torch's order, or
    None for the plain types (served as fp32)."""
    kind = tensor.tensor_type.name
    if kind in GGUF_PLAIN_TYPES:
        return None
    if kind not in GGUF_WQ_TYPES:
        check_tensor_types([tensor])
    cols, rows = (int(d) for d in tensor.shape.tolist())  # GGUF lists dimensions fastest first
    return decode_quantized(np.asarray(tensor.data).reshape(rows, -1), kind, rows, cols)
