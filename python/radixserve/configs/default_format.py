"""Which format the built-in model serves when the user names none: its own GGUF tensors
(--quantization gguf) on CPU, decided by measurement (docs/quantization.md, "The built-in model's
default format"), and fp32 wherever gguf would be slower or does not combine with a flag given.

The built-in model is converted from a Q4_1 GGUF: its fp32 weights are that file dequantized, and
gguf serves the same numbers from the file's integers (perplexity 34.81 for both on the repo's
fixed text), 1.79x fp32's tokens/s at concurrency 1. Called once from ServerArgs.resolve.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_FORMAT = "gguf"


def is_builtin_model(model_path: str | None) -> bool:
    """No --model-path, or one of the built-in model's names ("default", ...)."""
    from radixserve.model_loader.default_model import DEFAULT_MODEL_ALIASES

    return model_path is None or model_path.strip() in DEFAULT_MODEL_ALIASES


def wq_kernel_available() -> bool:
    """sgl-kernel's linear_wq is built (read at call time, so tests can take it away)."""
    from radixserve.layers import group_quant

    return bool(group_quant.WQ_KERNEL)


def _fp32_reason(args: ServerArgs) -> str | None:
    """Why the built-in model must serve fp32 under these flags, or None when gguf applies."""
    if not wq_kernel_available():
        # Without the kernel, gguf runs linear_wq's torch reference: correct but slower than fp32.
        return "this sgl-kernel build has no linear_wq (gguf's torch reference is slower than fp32)"
    if args.cpu_fp16_weights or args.cpu_bf16_gemm:
        # The user chose the weight format: fp16 copies / bf16 GEMMs of the fp32 weights.
        flag = "--cpu-fp16-weights" if args.cpu_fp16_weights else "--cpu-bf16-gemm"
        return f"{flag} asks for another weight format"
    if args.dtype not in ("auto", "float32", "float"):
        return f"--dtype {args.dtype} (gguf serves the fp32 model)"
    if args.is_embedding:
        return "--is-embedding (gguf serves generation models)"
    if args.load_format == "dummy":
        return "--load-format dummy (random weights, no GGUF tensors)"
    return None


def default_quantization(args: ServerArgs, device: str) -> str | None:
    """The --quantization the built-in model gets when neither --quantization nor --torchao-config
    is given: gguf on CPU, else None (fp32). Logs the choice and why; other models: None, silently."""
    if not is_builtin_model(args.model_path) or args.quantization is not None or args.torchao_config:
        return None
    if device != "cpu":
        return None  # --quantization runs on CPU only; the built-in model serves its dtype there
    reason = _fp32_reason(args)
    if reason is not None:
        logger.info(
            "Built-in model: serving fp32, not its GGUF tensors (the CPU default), because %s", reason
        )
        return None
    logger.info(
        "Built-in model: serving its own GGUF tensors (--quantization gguf, the CPU default): the "
        "fp32 weights exactly, faster decode (docs/quantization.md); --quantization unquant serves fp32"
    )
    return DEFAULT_FORMAT
