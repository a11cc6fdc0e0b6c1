"""Pre-quantized HF checkpoints: what config.json's `quantization_config` says, checked once.

SGLang's rule (its ModelConfig._verify_quantization): a checkpoint that carries a quantization
config selects the method itself, so `--quantization` may be left out; a flag that names another
method is an error, except the pairs SGLang declares compatible (`w8a8_int8` on a
compressed-tensors checkpoint). radixserve reads three kinds (docs/quantization.md):

- GPTQ int4 (`quant_method` "gptq"): qweight int32 [K/8, N] (8 inputs per word, input 8i+j in
  bits 4j..4j+3), qzeros int32 [K/G, N/8] (8 outputs per word, in order), scales fp16 [K/G, N],
  g_idx int32 [K]. Checkpoints in the original ("gptq", v1) format store each zero point minus
  one and readers add the one back; "gptq_v2" stores it as it is.
- AWQ int4 (`quant_method` "awq", version "gemm"): qweight int32 [K, N/8], qzeros int32
  [K/G, N/8], scales fp16 [K/G, N]; word nibble i holds output 8c + [0, 2, 4, 6, 1, 3, 5, 7][i].
- compressed-tensors W8A8 int8 (`quant_method` "compressed-tensors", format "int-quantized"):
  weight int8 [N, K] with weight_scale [N, 1], symmetric per output channel, activations
  quantized per token at run time (SGLang serves it with its w8a8_int8 scheme, as radixserve does);
  a MoE's routed experts `experts.{e}.{gate,up,down}_proj` are stored the same way, one expert
  and projection at a time. Any other scheme (int4 pack-quantized, FP8, static activations) is
  refused with the scheme named.

Every one dequantizes as w = scale * (q - zero). This module only reads JSON (no torch): the
launcher checks the flag against the checkpoint before any process starts.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

GPTQ = "gptq"
AWQ = "awq"
COMPRESSED_TENSORS = "compressed-tensors"
# Checkpoint methods radixserve loads, and the --quantization names that select each (SGLang's
# names; gptq_marlin / awq_marlin are its GPU kernels for the same checkpoints, accepted so that
# command lines written for SGLang work: on CPU the checkpoint is served the same way).
FLAGS_FOR_METHOD: dict[str, tuple[str, ...]] = {
    GPTQ: ("gptq", "gptq_marlin"),
    AWQ: ("awq", "awq_marlin"),
    COMPRESSED_TENSORS: ("compressed-tensors", "w8a8_int8"),
}
# Flags that only make sense with a pre-quantized checkpoint (w8a8_int8 also quantizes at load).
PREQUANTIZED_ONLY_FLAGS = ("gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors")
# The value --quantization resolves to when the flag is left out or names a compatible kernel.
_RESOLVED_NAME = {"gptq_marlin": GPTQ, "awq_marlin": AWQ}
_INT_FORMATS = ("int-quantized", "naive-quantized")


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint's linear weights are stored."""

    method: str  # GPTQ, AWQ or COMPRESSED_TENSORS
    bits: int
    # Inputs per scale; -1: one scale per output channel (the whole row).
    group_size: int
    # Added to the stored zero point (GPTQ v1 checkpoints store zero - 1).
    zero_offset: int = 0
    desc_act: bool = False

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.method} int{self.bits} ({group})"


def read_quantization_config(model_path: str | None) -> dict[str, Any] | None:
    """config.json's `quantization_config` (or the older `compression_config`), or None when the
    folder has none (or no readable config.json: the model loader reports that later)."""
    if not model_path:
        return None
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    found = config.get("quantization_config") or config.get("compression_config")
    return found if isinstance(found, dict) else None


def parse_quantization_config(cfg: dict[str, Any]) -> CheckpointQuant:
    """The CheckpointQuant of a `quantization_config`; ValueError naming what is not supported."""
    method = str(cfg.get("quant_method", "")).lower().replace("_", "-")
    if method == GPTQ:
        return _parse_gptq(cfg)
    if method == AWQ:
        return _parse_awq(cfg)
    if method == COMPRESSED_TENSORS:
        return _parse_compressed_tensors(cfg)
    raise ValueError(
        f"The checkpoint is quantized with {cfg.get('quant_method')!r}; radixserve loads GPTQ and AWQ "
        "int4 and compressed-tensors W8A8 int8 checkpoints (docs/quantization.md)"
    )


def _bits(cfg: dict[str, Any], method: str, *keys: str) -> int:
    bits = next((cfg[k] for k in keys if k in cfg), None)
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits}-bit weights are not supported: only 4-bit")
    return 4


def _group_size(cfg: dict[str, Any], method: str, *keys: str) -> int:
    group = int(next((cfg[k] for k in keys if k in cfg), -1))
    if group != -1 and (group <= 0 or group % 16):
        raise ValueError(f"{method} group_size {group} is not supported: a multiple of 16, or -1")
    return group


def _parse_gptq(cfg: dict[str, Any]) -> CheckpointQuant:
    bits = _bits(cfg, "GPTQ", "bits")
    group = _group_size(cfg, "GPTQ", "group_size")
    fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported: 'gptq' or 'gptq_v2'")
    if cfg.get("dynamic"):
        raise ValueError("GPTQ checkpoints with per-module overrides ('dynamic') are not supported")
    # desc_act (act-order) is checked per layer on g_idx when loading: only a permuted g_idx is refused.
    return CheckpointQuant(GPTQ, bits, group, 1 if fmt == "gptq" else 0, bool(cfg.get("desc_act")))


def _parse_awq(cfg: dict[str, Any]) -> CheckpointQuant:
    bits = _bits(cfg, "AWQ", "bits", "w_bit")
    group = _group_size(cfg, "AWQ", "group_size", "q_group_size")
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: only 'gemm' (AutoAWQ's default layout)")
    if cfg.get("zero_point") is False:
        raise ValueError("AWQ checkpoints without zero points (zero_point: false) are not supported")
    return CheckpointQuant(AWQ, bits, group)


def _parse_compressed_tensors(cfg: dict[str, Any]) -> CheckpointQuant:
    """Every config group must be W8A8 int8: the scheme applies to whatever its `targets` match,
    dense linears and a MoE's routed experts alike (SGLang picks its MoE method from the same
    scheme), so one group of another scheme is refused, named, before anything loads."""
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ValueError(
            "compressed-tensors checkpoint without config_groups: nothing says how it is quantized"
        )
    if cfg.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors checkpoints with a quantized KV cache are not supported")
    for name, group in groups.items():
        fmt = group.get("format") or cfg.get("format")
        weights, acts = group.get("weights"), group.get("input_activations")
        if fmt in _INT_FORMATS and _is_int8(weights, "channel", False) and _is_int8(acts, "token", True):
            continue
        raise ValueError(
            f"compressed-tensors config group {name} (targets {group.get('targets')}) is "
            f"{describe_scheme(weights, acts, fmt)}: not supported. radixserve loads W8A8 int8 "
            "(format 'int-quantized': symmetric int8 weights per output channel, dynamic int8 "
            "activations per token), for dense linears and MoE experts alike (docs/quantization.md)"
        )
    return CheckpointQuant(COMPRESSED_TENSORS, 8, -1)


def _is_int8(args: Any, strategy: str, dynamic: bool) -> bool:  # noqa: ANN401
    wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic}
    return isinstance(args, dict) and {k: args.get(k) for k in wanted} == wanted


def describe_scheme(weights: Any, acts: Any, fmt: str | None) -> str:  # noqa: ANN401
    """A compressed-tensors scheme in words, e.g. "W4A16 (weights int4 symmetric per group of 128;
    activations unquantized; format 'pack-quantized')"."""

    def side(args: Any, what: str) -> tuple[str, str]:  # noqa: ANN401
        if not isinstance(args, dict):
            return "16", f"{what} unquantized"
        bits, kind = args.get("num_bits"), args.get("type", "int")
        strategy = args.get("strategy")
        per = f"per group of {args.get('group_size')}" if strategy == "group" else f"per {strategy}"
        symmetric = "symmetric" if args.get("symmetric", True) else "asymmetric"
        dynamic = ", dynamic" if args.get("dynamic") else (", static" if what == "activations" else "")
        return str(bits), f"{what} {kind}{bits} {symmetric} {per}{dynamic}"

    (w_bits, w_text), (a_bits, a_text) = side(weights, "weights"), side(acts, "activations")
    fp8 = "FP8 " if isinstance(weights, dict) and weights.get("type") == "float" else ""
    return f"{fp8}W{w_bits}A{a_bits} ({w_text}; {a_text}; format {fmt!r})"


def resolve_quantization(flag: str | None, model_path: str | None) -> str | None:
    """The --quantization the server runs: the checkpoint's method when it has one (logged), the
    flag otherwise. Raises ValueError for a flag that conflicts with the checkpoint, for a
    pre-quantized-only flag without such a checkpoint, and for checkpoints radixserve cannot read."""
    cfg = read_quantization_config(model_path)
    if cfg is None:
        if flag in PREQUANTIZED_ONLY_FLAGS:
            raise ValueError(
                f"--quantization {flag} loads a pre-quantized checkpoint, but {model_path or 'the built-in model'} "
                "has no quantization_config in config.json. To quantize an fp32/bf16 checkpoint at load, "
                "use --quantization w8a8_int8 (docs/quantization.md)"
            )
        return flag
    spec = parse_quantization_config(cfg)
    if flag is None:
        logger.info(
            "Checkpoint %s is %s: serving it with --quantization %s", model_path, spec.describe(), spec.method
        )
        return spec.method
    if flag not in FLAGS_FOR_METHOD[spec.method]:
        raise ValueError(
            f"Quantization method specified in the model config ({spec.method}) does not match the "
            f"quantization method specified in the `quantization` argument ({flag}). Drop "
            f"--quantization to serve the checkpoint as it is quantized."
        )
    resolved = _RESOLVED_NAME.get(flag, flag)
    logger.info(
        "Checkpoint %s is %s: serving it with --quantization %s", model_path, spec.describe(), resolved
    )
    return resolved


def checkpoint_quantization(model_path: str) -> CheckpointQuant | None:
    """The CheckpointQuant of the checkpoint at `model_path`, None for an unquantized one."""
    cfg = read_quantization_config(model_path)
    return None if cfg is None else parse_quantization_config(cfg)
