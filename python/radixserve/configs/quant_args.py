"""The server arguments of the weight-only modes: --quantization gguf (with SGLang's GGUF model
paths and --load-format gguf) and --torchao-config. Kept apart from server_args.py, which calls
these from ServerArgs.resolve and validate."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs


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
