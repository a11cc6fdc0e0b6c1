"""The cache of the CPU tuning (cpu_tuning.py): one JSON file per (CPU, model) in
$RADIXSERVE_CPU_TUNING_DIR (default ~/.cache/radixserve/cpu_tuning), keyed on what a crossover
depends on besides the weights' values: the CPU and its flags, the threads, torch, the kernel
build, and the layers' shapes and forms. Writes are atomic, so two servers starting at once never
read half a file."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from radixserve.layers.cpu_crossovers import DEFAULTS, Crossovers
from radixserve.layers.cpu_fused import cpu_kernels
from radixserve.layers.linear import Linear

logger = logging.getLogger(__name__)

CACHE_VERSION = 6  # v3: wq_batch_a8; v4: moe_a8 (and the experts in the key); v5: wq_a8_small_panels;
# v6: wq_batch_a8_max_tokens (a start re-measures, so a CPU that refused the batch panels may take them bounded)
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_identity() -> dict[str, Any]:
    """What the crossovers depend on besides the model: the CPU, the threads, torch, the kernels."""
    name, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    ext = getattr(getattr(cpu_kernels, "_ext", None), "__file__", None)
    kernel = f"{os.path.getsize(ext)}-{int(os.path.getmtime(ext))}" if ext and os.path.exists(ext) else "none"
    return {
        "cpu": name,
        "flags": [f for f in CPU_FLAGS if f in flags],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernel": kernel,
    }


def model_identity(layers: list[Linear]) -> list[list[Any]]:
    """The layers' shapes and forms, in order (the weights' values do not move a crossover)."""
    return [
        [m.in_features, m.out_features, str(m.weight_packed.dtype), _wq_kind(m), m.weight_f16 is not None]
        for m in layers
    ]


def _wq_kind(layer: Linear) -> str:
    wq = layer.weight_wq
    return (
        "" if wq is None else f"{type(wq).__name__}:{getattr(wq, 'bits', '')}:{getattr(wq, 'group_size', '')}"
    )


def cache_dir() -> Path:
    """$RADIXSERVE_CPU_TUNING_DIR, else <$RADIXSERVE_CACHE_DIR or ~/.cache/radixserve>/cpu_tuning."""
    from radixserve.model_loader.default_model import cache_root

    folder = os.environ.get("RADIXSERVE_CPU_TUNING_DIR")
    return Path(folder).expanduser() if folder else cache_root() / "cpu_tuning"


def cache_path(layers: list[Linear], experts: list[list[Any]] | None = None) -> Path:
    """experts: the quantized MoE layers' identity (cpu_tuning_moe.moe_identity), if any."""
    key = [CACHE_VERSION, cpu_identity(), model_identity(layers)] + ([experts] if experts else [])
    key = json.dumps(key, sort_keys=True).encode()
    return cache_dir() / f"{hashlib.sha256(key).hexdigest()[:24]}.json"


def read_cache(path: Path) -> Crossovers:
    data = json.loads(path.read_text())
    # A cache from before the int8-activation bound existed: not measured, so off (its default).
    stored = {
        "wq_a8_max_tokens": DEFAULTS.wq_a8_max_tokens,
        "wq_batch_a8_max_tokens": DEFAULTS.wq_batch_a8_max_tokens,
        **data["bounds"],
    }
    bounds = {k: int(stored[k]) for k in Crossovers.BOUNDS}
    # Missing (written by hand or before the choice): not measured, so the exact fp32 GEMM.
    bf16, a8 = data.get("wq_batch_bf16", False), data.get("wq_batch_a8", False)
    moe, small = data.get("moe_a8", False), data.get("wq_a8_small_panels", False)
    choices = (("wq_batch_bf16", bf16), ("wq_batch_a8", a8), ("moe_a8", moe), ("wq_a8_small_panels", small))
    for name, value in choices:
        if not isinstance(value, bool):
            raise TypeError(f"{name} is {value!r}, not true or false")
    return Crossovers(
        **bounds,
        wq_batch_bf16=bf16,
        wq_batch_a8=a8,
        moe_a8=moe,
        wq_a8_small_panels=small,
        source=f"cached {data.get('measured_at', '?')} at {path}",
    )


def write_cache(path: Path, crossovers: Crossovers, timings: dict[str, Any]) -> None:
    data = {
        "bounds": crossovers.bounds(),
        "wq_batch_bf16": crossovers.wq_batch_bf16,
        "wq_batch_a8": crossovers.wq_batch_a8,
        "moe_a8": crossovers.moe_a8,
        "wq_a8_small_panels": crossovers.wq_a8_small_panels,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_identity(),
        # Per bound and token count: (the small kernel, oneDNN's GEMM) ms per pass; for
        # wq_a8_max_tokens (linear_wq_a8, linear_wq); for wq_batch_bf16 per row count (oneDNN
        # fp32, oneDNN bf16); for wq_batch_a8 per row count (the better oneDNN GEMM, int8
        # activations on panels); wq_max_tokens' GEMM is the one that won; for moe_a8 per token
        # count (the exact grouped experts, the one-call kernel on panels).
        "timings_ms_small_vs_gemm": timings,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)  # atomic: two servers starting at once never read half a file
    except OSError as exc:
        logger.warning("CPU tuning: could not cache the crossovers at %s (%s)", path, exc)
