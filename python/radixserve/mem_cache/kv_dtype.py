"""What `--kv-cache-dtype` stores in the KV pool, and how a write quantizes to it.

SGLang's names: `auto` (the model dtype; ServerArgs.resolve turns it into `bf16` for quantized
models on CPU: configs/kv_cache_args.py), `bf16`/`bfloat16`, `fp8_e4m3`, `fp8_e5m2`; radixserve's
`float32` (fp32 K/V for an fp32 model, whatever its weights' format). fp8 is
stored with a scale of 1.0, as SGLang does without checkpoint scales: values are saturated at the
format's largest finite value (e4m3fn has no infinity, and a plain cast of a larger value gives
NaN). `int8` is radixserve's own (CPU): int8 K/V with one fp32 scale per (token, KV head),
symmetric (scale = amax / 127), so a token's scale follows its own range instead of a fixed one;
the scales sit beside the data in the pool ([size, num_kv_heads] per layer, K and V each).
"""

from __future__ import annotations

import torch

from radixserve.server_args import KV_CACHE_DTYPES

_STORAGE = {
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
INT8_MAX = 127.0


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype for a --kv-cache-dtype value (int8: int8 data plus fp32 scales)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _STORAGE:
        raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _STORAGE[kv_cache_dtype]


def has_scales(dtype: torch.dtype) -> bool:
    """int8 pools keep a per-(token, KV head) scale beside the data; the other dtypes need none."""
    return dtype == torch.int8


def bytes_per_element_row(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one (token, KV head) row of K (or V) takes, its scale included."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return head_dim * itemsize + (4 if has_scales(dtype) else 0)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, num_kv_heads, head_dim] -> (int8 [N, num_kv_heads, head_dim], fp32 scale [N, num_kv_heads])
    with x ~= q * scale: scale = amax * (1/127) per row, round half to even. An all-zero row gets
    scale 1. sgl-kernel's store_kv computes the same fp32 operations (the same bits)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)  # [N, num_kv_heads]
    scale = torch.where(amax > 0, amax * (1.0 / INT8_MAX), torch.ones_like(amax))
    q = torch.round(x / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x cast to a non-int8 pool dtype; fp8 saturates at its largest finite value."""
    limit = _FP8_MAX.get(dtype)
    if limit is not None:
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a pool ([N, num_kv_heads, head_dim]) back in `dtype`; scale [N, num_kv_heads]
    for int8 pools, None otherwise."""
    if scale is None:
        return x.to(dtype)
    return (x.to(torch.float32) * scale[..., None]).to(dtype)


_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def index_copy_rows_(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(dim, index, src) for every pool dtype: torch has no CPU index_copy_ for fp8,
    so 1-byte floats copy as their bytes (a same-size dtype view, any strides)."""
    if dst.dtype in _BYTE_FLOATS:
        dst, src = dst.view(torch.uint8), src.to(dst.dtype).view(torch.uint8)
    dst.index_copy_(dim, index, src)
