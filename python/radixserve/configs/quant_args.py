"""ServerArgs' weight-quantization flags: --quantization (SGLang's names; with its GGUF model paths
and --load-format gguf) and --torchao-config, their automatic values and their checks. Kept apart
from server_args.py, which calls these from ServerArgs.resolve and validate."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from radixserve.configs.arg_field import arg_field
from radixserve.configs.checkpoint_quant import resolve_quantization

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

# SGLang's --quantization names (its QUANTIZATION_CHOICES). Only SUPPORTED_QUANTIZATION is
# implemented here; the others are refused at start with a message (docs/quantization.md).
QUANTIZATION_METHODS = tuple(
    "awq fp8 mxfp8 gptq marlin gptq_marlin awq_marlin bitsandbytes gguf modelopt modelopt_fp8 modelopt_fp4 "
    "nvfp4_online modelopt_mixed petit_nvfp4 w8a8_int8 w8a8_fp8 moe_wna16 w4afp8 mxfp4 auto-round "
    "auto-round-int8 compressed-tensors modelslim mxfp_w4a8 quark quark_int4fp8_moe quark_mxfp4 mlx_q4 "
    "mlx_q8 unquant humming".split()
)
# w8a8_int8 quantizes an fp32/bf16/fp16 checkpoint at load, or loads a compressed-tensors W8A8
# one; gguf serves a GGUF file's quantized tensors; the others load pre-quantized checkpoints
# (configs/checkpoint_quant.py).
SUPPORTED_QUANTIZATION = tuple("w8a8_int8 gguf gptq gptq_marlin awq awq_marlin compressed-tensors".split())
# SGLang's explicit "no quantization": accepted, and resolved to None.
NO_QUANTIZATION = "unquant"

# ServerArgs' quantization fields (server_args.py declares each under the same name).
quantization = arg_field(
    None,
    "Quantize the weights (SGLang's names; docs/quantization.md). w8a8_int8: on CPU, the decoder "
    "layers' linear weights (QKV, o_proj, gate_up, down; a MoE's routed experts, not its router) are quantized at load to int8 with a "
    "scale per output channel, and activations per token at run time, for int8 dot products "
    "(sgl-kernel); the LM head gets an int8 weight-only form (GGUF Q8_0's layout: a scale per "
    "32 inputs) for batches of up to 8 tokens, unlike SGLang, which keeps it unquantized; the "
    "embedding stays fp32, as does the head for larger batches. gguf: the decoder linears and the LM head of a GGUF model (--model-path "
    "to a .gguf file, which selects it by itself, or the built-in model) serve from the file's own "
    "Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors for batches of up to 8 tokens, larger batches from their "
    "exact fp32 dequantization; a file with other quantized types is refused. A pre-quantized "
    "checkpoint (GPTQ or AWQ int4, compressed-tensors W8A8 int8, its MoE experts too) selects its method from "
    "config.json's quantization_config without the flag; a flag naming another method is an "
    "error. unquant: none (a GGUF file then serves dequantized to fp32). Other SGLang names (fp8, "
    "bitsandbytes, ...) are refused at start. Default: the checkpoint's; the built-in model on CPU: "
    "gguf (its own tensors, the fp32 weights exactly; fp32 where sgl-kernel lacks linear_wq or with "
    "--cpu-fp16-weights, --cpu-bf16-gemm, a 16-bit --dtype, --is-embedding, --load-format dummy); else "
    "none (fp32).",
)
torchao_config = arg_field(
    "",
    "On-the-fly weight-only quantization of the decoder linears (SGLang's flag and names; CPU, "
    "fp32 models): int8wo (int8, symmetric, a scale per output channel) or int4wo-<group_size> "
    "(4 bits, asymmetric, a scale and an offset per group of 32, 64, 128 or 256 inputs; layers "
    "whose inputs the group does not divide stay fp32). Their fp32 weights are replaced by the "
    "dequantization, so every batch size computes with the quantized model. SGLang's other "
    "choices (int8dq, fp8wo, fp8dq-*) are refused. Default: none.",
)


def quantization_updates(args: ServerArgs, device: str) -> dict[str, Any]:
    """The weight format resolved once: a GGUF file's, the built-in model's default, or the one a
    pre-quantized checkpoint names."""
    from radixserve.configs.default_format import default_quantization

    updates = gguf_updates(args)  # a GGUF --model-path: --quantization gguf (SGLang's rule)
    # The built-in model without a format flag: its own GGUF tensors on CPU (logged), else fp32.
    method = updates.get("quantization", args.quantization) or default_quantization(args, device)
    if method is None or method in QUANTIZATION_METHODS:  # other names: validate() says
        # A pre-quantized checkpoint selects its method; a conflicting flag (unquant too) is an error.
        method = resolve_quantization(method, args.model_path)
    updates["quantization"] = None if method == NO_QUANTIZATION else method
    return updates


def gguf_updates(args: ServerArgs) -> dict[str, Any]:
    """SGLang's rule: a --model-path that is a GGUF file, with --load-format auto or gguf, loads as
    GGUF and serves its quantized tensors (--quantization gguf). Asking for no quantization
    (--quantization unquant) serves the file dequantized to fp32 instead, and --torchao-config
    quantizes that fp32 model."""
    from radixserve.model_loader.gguf_source import gguf_source, is_gguf_file

    path = os.path.expanduser(args.model_path) if args.model_path else None
    if args.load_format in ("auto", "gguf") and is_gguf_file(path):
        updates: dict[str, Any] = {"load_format": "gguf"}
        if args.quantization is None and not args.torchao_config:
            updates["quantization"] = "gguf"
        return updates
    if args.load_format == "gguf" and not (path and os.path.isdir(path) and gguf_source(path)):
        raise ValueError(f"--load-format gguf needs --model-path to a GGUF file, got {args.model_path!r}")
    return {}


def validate_quantization(args: ServerArgs) -> None:
    method = args.quantization
    if method is None:
        return
    supported = ", ".join(SUPPORTED_QUANTIZATION)
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"--quantization {method!r} is not a quantization method SGLang defines; supported "
            f"here: {supported} (docs/quantization.md)"
        )
    if method not in SUPPORTED_QUANTIZATION:
        raise ValueError(
            f"--quantization {method} is not supported by radixserve yet; supported: {supported} "
            "(w8a8_int8 quantizes an fp32/bf16/fp16 checkpoint at load; gguf serves a GGUF file's "
            "quantized tensors; the others load pre-quantized checkpoints, on CPU; docs/quantization.md)"
        )
    if args.device != "cpu":
        raise ValueError(f"--quantization {method} runs on CPU only for now (got --device {args.device})")
    if args.dtype not in ("auto", "float32", "float"):
        raise ValueError(
            f"--quantization {method} quantizes the fp32 model (bf16/fp16 checkpoints load as fp32 "
            f"first): drop --dtype {args.dtype}"
        )
    if args.is_embedding:
        raise ValueError(f"--quantization {method} applies to generation models for now: drop --is-embedding")


def validate_weight_only(args: ServerArgs) -> None:
    """What --quantization gguf and --torchao-config need (the device, dtype and model checks of
    --quantization are configs/server_args_checks.py's)."""
    if args.quantization == "gguf" and args.load_format == "dummy":
        raise ValueError("--quantization gguf serves a GGUF file's tensors: drop --load-format dummy")
    config = args.torchao_config
    if not config:
        return
    from radixserve.layers.weight_only import parse_torchao_config

    parse_torchao_config(config)  # ValueError naming what is supported
    if args.quantization is not None:
        raise ValueError(
            f"--torchao-config {config} quantizes the fp32 model on the fly; it does not combine with "
            f"--quantization {args.quantization}: choose one"
        )
    if args.device != "cpu":
        raise ValueError(f"--torchao-config runs on CPU only for now (got --device {args.device})")
    if args.dtype not in ("auto", "float32", "float"):
        raise ValueError(f"--torchao-config {config} quantizes the fp32 model: drop --dtype {args.dtype}")
    if args.is_embedding:
        raise ValueError(
            f"--torchao-config {config} applies to generation models for now: drop --is-embedding"
        )
