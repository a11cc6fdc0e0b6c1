"""--kv-cache-dtype: what `auto` stores, and the combinations that cannot work (refused at start
with the flag to change).

SGLang's `auto` is the model dtype. On CPU radixserve's `auto` stores bf16 K/V for a model whose
weights are already not exact (any --quantization, the built-in model's GGUF default included, or
--torchao-config) and that computes in fp32: half the bytes a decode step reads at long contexts,
for a perplexity cost of +0.02% on the built-in model (docs/benchmarks.md "KV cache dtypes"), the
band docs/quantization.md calls keeping fp32's quality. Unquantized fp32 models keep fp32 K/V (exact:
the HF parity tests); `--kv-cache-dtype float32` forces fp32 K/V for any model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The backends whose kernels read every --kv-cache-dtype pool (dequantizing as they read).
KV_DTYPE_BACKENDS = ("cpu", "torch_native")
# What `auto` stores on CPU for a quantized fp32-math model (see the module docstring).
CPU_QUANTIZED_KV_DTYPE = "bf16"
FP32_DTYPES = ("auto", "float32", "float")


def resolve_kv_cache_dtype(
    args: ServerArgs, device: str, attention_backend: str | None, quantized: bool
) -> str:
    """The --kv-cache-dtype to serve with: the flag as typed, except `auto` on CPU for a quantized
    model in fp32 math whose attention backend reads bf16 pools, which becomes bf16 (logged).
    quantized: the resolved weight format is not the plain model (a --quantization method, or a
    --torchao-config)."""
    kv = args.kv_cache_dtype
    if kv != "auto" or device != "cpu" or not quantized:
        return kv
    if args.dtype not in FP32_DTYPES or attention_backend not in KV_DTYPE_BACKENDS:
        return kv
    logger.info(
        "KV cache: --kv-cache-dtype auto stores %s for this quantized model on CPU (half fp32's bytes, "
        "perplexity +0.02%% on the built-in model; --kv-cache-dtype float32 keeps fp32 K/V)",
        CPU_QUANTIZED_KV_DTYPE,
    )
    return CPU_QUANTIZED_KV_DTYPE


def validate_kv_cache_dtype(args: ServerArgs) -> None:
    kv = args.kv_cache_dtype  # one of its declared choices, checked with every flag's
    if kv == "auto":
        return
    if kv == "float32" and args.dtype not in FP32_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype float32 stores fp32 K/V for an fp32 model; with --dtype {args.dtype} use "
            "auto (the model dtype)"
        )
    if kv == "float32":
        return  # what auto stores for an fp32 model: every backend reads it
    if args.device == "cuda":
        # A bf16 pool under a bf16 model is what auto gives; the Triton/FlashInfer kernels read
        # the pool in the model dtype only (no fp8/int8 dequantization in them yet).
        if kv in ("bf16", "bfloat16") and args.dtype in ("auto", "bfloat16", "bf16"):
            return
        raise ValueError(
            f"--kv-cache-dtype {kv} is not supported on CUDA here (the Triton/FlashInfer kernels read "
            "the pool in the model dtype): use auto, or bf16 with a bf16 model"
        )
    if args.attention_backend is not None and args.attention_backend not in KV_DTYPE_BACKENDS:
        raise ValueError(
            f"--kv-cache-dtype {kv} needs --attention-backend cpu or torch_native, got "
            f"{args.attention_backend}"
        )
    if kv != "int8":
        return
    if args.enable_hierarchical_cache:
        raise ValueError(
            "--kv-cache-dtype int8 keeps per-token scales that the HiCache host tier does not hold: "
            "drop --enable-hierarchical-cache, or use bf16 / fp8_e4m3 / fp8_e5m2"
        )
    if args.disaggregation_mode != "null":
        raise ValueError(
            "--kv-cache-dtype int8 keeps per-token scales that the PD KV transfer does not carry: use "
            "bf16 / fp8_e4m3 / fp8_e5m2 with --disaggregation-mode"
        )
