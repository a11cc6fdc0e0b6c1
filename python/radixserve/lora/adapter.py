"""A LoRA adapter in PEFT's format, read into host memory and checked against the base model.

A PEFT adapter folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, ...)
and `adapter_model.safetensors` with, per adapted projection, `...layers.{i}.{parent}.{module}.lora_A.weight`
[r, in_features] and `...lora_B.weight` [out_features, r]. The delta of a projection is
y += scaling * (x @ A^T) @ B^T with scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).

Everything a file can get wrong is refused here with `LoRAError` (a ValueError: HTTP 400), before
any slot of the compute pool is touched: a rank above --max-lora-rank, a module the server was not
started for, shapes of another base model, a missing or corrupt file.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

# PEFT's module names -> the base model's projection. q/k/v are slices of the fused qkv_proj and
# gate/up of the fused gate_up_proj (models/llama.py).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SHORT_NAMES = {m.split("_")[0]: m for m in LORA_MODULES}  # "q" -> "q_proj", ...
_WEIGHT_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED_CONFIG = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")


class LoRAError(ValueError):
    """An adapter that cannot be served, with the reason (HTTP 400)."""


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: per projection (in_features, out_features), and the layer count."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of_model(cls, model_config: Any) -> BaseShapes:  # noqa: ANN401 - a ModelConfig
        hf = model_config.hf_config
        hidden, inter = model_config.hidden_size, int(hf.intermediate_size)
        q_out = model_config.num_heads * model_config.head_dim
        kv_out = model_config.num_kv_heads * model_config.head_dim
        shapes = {
            "q_proj": (hidden, q_out),
            "k_proj": (hidden, kv_out),
            "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(model_config.num_layers, shapes)


def normalize_target_modules(names: list[str] | tuple[str, ...] | str) -> tuple[str, ...]:
    """PEFT / SGLang spellings ("q_proj", "q", "all", "all-linear") -> canonical names, in order."""
    items = [names] if isinstance(names, str) else list(names)
    out: set[str] = set()
    for raw in items:
        name = raw.rsplit(".", 1)[-1]
        if name in ("all", "all-linear"):
            out.update(LORA_MODULES)
        elif name in LORA_MODULES or name in _SHORT_NAMES:
            out.add(_SHORT_NAMES.get(name, name))
        else:
            raise LoRAError(
                f"LoRA target module {raw!r} is not supported; supported: {', '.join(LORA_MODULES)}"
            )
    return tuple(m for m in LORA_MODULES if m in out)


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in host memory: weights[(layer, module)] = (A [r, in], B [out, r] * scaling)."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: str) -> dict[str, Any]:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise LoRAError(f"LoRA adapter {path!r}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {path!r}: adapter_config.json is unreadable: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAError(f"LoRA adapter {path!r}: adapter_config.json has no positive integer 'r'")
    for key in _REFUSED_CONFIG:
        if config.get(key):
            raise LoRAError(f"LoRA adapter {path!r}: '{key}' is not supported")
    if config.get("fan_in_fan_out") or config.get("use_dora"):
        raise LoRAError(f"LoRA adapter {path!r}: fan_in_fan_out and DoRA adapters are not supported")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise LoRAError(f"LoRA adapter {path!r}: no adapter_model.safetensors")
    try:
        return load_file(weights_file)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"LoRA adapter {path!r}: adapter_model.safetensors is corrupt: {e}") from None


def load_adapter(
    name: str, path: str, base: BaseShapes, max_rank: int, enabled_modules: tuple[str, ...]
) -> LoRAAdapter:
    """Read and check the adapter at `path`; the server serves ranks up to `max_rank` and adapts
    `enabled_modules` (the compute pool has buffers for those only)."""
    config = read_adapter_config(path)
    rank = int(config["r"])
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    targets = normalize_target_modules(config.get("target_modules") or [])
    missing = [m for m in targets if m not in enabled_modules]
    if missing:
        raise LoRAError(
            f"LoRA adapter {name!r} adapts {missing}, which the server was not started for "
            f"(--lora-target-modules {' '.join(enabled_modules)})"
        )
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        match = _WEIGHT_NAME.search(key)
        if match is None:
            raise LoRAError(f"LoRA adapter {name!r}: unexpected tensor {key!r}")
        layer, module, ab = int(match.group(1)), match.group(2), match.group(3)
        if module not in targets:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} of a module not in target_modules")
        if layer >= base.num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer}, the base model has {base.num_layers}")
        pairs.setdefault((layer, module), {})[ab] = tensor
    weights = {key: _checked_pair(name, key, ab, rank, base, scaling) for key, ab in pairs.items()}
    return LoRAAdapter(name, path, rank, scaling, targets, weights)


def _checked_pair(
    name: str,
    key: tuple[int, str],
    ab: dict[str, torch.Tensor],
    rank: int,
    base: BaseShapes,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    layer, module = key
    if set(ab) != {"A", "B"}:
        raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
    in_features, out_features = base.shapes[module]
    a, b = ab["A"], ab["B"]
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise LoRAError(
            f"LoRA adapter {name!r} does not fit this base model: layer {layer} {module} has "
            f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, the base model needs "
            f"({rank}, {in_features}) and ({out_features}, {rank})"
        )
    # Scaling folded into B once here, so the forward multiplies by nothing.
    return a.float().contiguous(), (b.float() * scaling).contiguous()


def parse_lora_paths(items: list[str] | tuple[str, ...] | None) -> dict[str, str]:
    """--lora-paths entries, "name=path" or a bare path (named by itself), -> {name: path}."""
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep:
            name = path = item
        if not name or not path:
            raise ValueError(f"--lora-paths entry {item!r} must be NAME=PATH or PATH")
        if name in out:
            raise ValueError(f"--lora-paths names {name!r} twice")
        out[name] = path
    return out


def lora_updates(args: Any) -> dict[str, Any]:  # noqa: ANN401 - a ServerArgs being resolved
    """ServerArgs.resolve's LoRA decisions: the rank and modules the pool is built for (from the
    --lora-paths adapters' configs when not given), and decode CUDA graphs off (they have no
    delta; the CPU fused decode has: model_executor/cpu_decode_runner.py)."""
    paths = parse_lora_paths(args.lora_paths)
    configs = [read_adapter_config(p) for p in paths.values()]
    rank = args.max_lora_rank
    if rank is None:
        rank = max((int(c["r"]) for c in configs), default=16)
    modules = args.lora_target_modules
    if modules:
        modules = normalize_target_modules(modules)
    elif configs:
        modules = normalize_target_modules([m for c in configs for m in c.get("target_modules") or []])
    else:
        modules = LORA_MODULES
    return {
        "enable_lora": True,
        "lora_paths": tuple(f"{n}={p}" for n, p in paths.items()),
        "max_lora_rank": rank,
        "lora_target_modules": modules,
        "disable_cuda_graph": True,
    }


def validate_lora_args(args: Any) -> None:  # noqa: ANN401 - a resolved ServerArgs
    if args.max_loras_per_batch < 1:
        raise ValueError(f"--max-loras-per-batch must be >= 1, got {args.max_loras_per_batch}")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be >= 1, got {args.max_lora_rank}")
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        raise ValueError("--max-loaded-loras must be at least --max-loras-per-batch")
    if args.is_embedding:
        raise ValueError("--enable-lora applies to generation models: drop --is-embedding")
    if args.speculative_algorithm not in (None, "NGRAM"):
        raise ValueError("--enable-lora runs with NGRAM speculation only: draft models know no adapters")
