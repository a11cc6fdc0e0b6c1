"""--kv-cache-dtype: the combinations that cannot work, refused at start with the flag to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

# The backends whose kernels read every --kv-cache-dtype pool (dequantizing as they read).
KV_DTYPE_BACKENDS = ("cpu", "torch_native")


def validate_kv_cache_dtype(args: ServerArgs) -> None:
    kv = args.kv_cache_dtype  # one of its declared choices, checked with every flag's
    if kv == "auto":
        return
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
