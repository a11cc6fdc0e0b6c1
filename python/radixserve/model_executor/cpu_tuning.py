"""Per-machine crossovers of the CPU linear forms: measured once per CPU and model, then cached.

`layers/linear.py` runs small batches through sgl-kernel's small-M kernels (linear_wq over a
weight-only quantized form, linear_f32, linear_f16) and larger ones through oneDNN's GEMM over the
prepacked weight. Where one overtakes the other depends on the CPU (AVX2 vs AVX-512, cache sizes,
memory bandwidth), so a bound chosen on one machine is wrong on the next. `--cpu-kernel-tuning`:

- `auto` (default): the bounds cached for this CPU and model (layers' shapes and forms), else a
  short measurement (a second or two on the built-in model) that is then cached: only when the
  machine is quiet, since a measurement beside other work would pick the other work's bounds; on a
  busy machine the defaults serve and a later start measures.
- `measure`: measure now whatever the load, and overwrite the cache.
- `off`: the defaults (layers/cpu_crossovers.py), as the parity tests run.

`--cpu-kernel-crossovers '{"wq_max_tokens": 4}'` overrides single bounds on top of any of these.
The cache is a JSON file per (CPU, model) in $RADIXSERVE_CPU_TUNING_DIR (default
~/.cache/radixserve/cpu_tuning); delete it to measure again. Multi-rank runs use the defaults (each rank
would measure alone, and the ranks' fused decode paths must agree on their batch bounds).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from radixserve.layers import cpu_fused
from radixserve.layers.cpu_crossovers import DEFAULTS, Crossovers, install, parse_overrides
from radixserve.layers.cpu_fused import cpu_kernels, fusable
from radixserve.layers.group_quant import linear_wq
from radixserve.layers.linear import Linear, _linear_bf16
from radixserve.utils.cpus import available_cpus

logger = logging.getLogger(__name__)

TUNING_MODES = ("auto", "measure", "off")
# Token counts tried per bound, ascending; the bound is the last one where the small kernel still
# wins (and it never goes below the first: at one token each small kernel reads the fewest bytes).
CANDIDATES = {
    "wq_max_tokens": (1, 2, 4, 6, 8, 12, 16, 24, 32),
    "f32_small_max_tokens": (1, 2, 3, 4, 6, 8),
    "f16_max_tokens": (2, 4, 8, 12, 16, 24, 32),
}
# A pass reads at most this many bytes of weights (whole layers, in model order): past any
# last-level cache, so they stream from memory as in a real step, and bounded for big models.
MAX_PASS_BYTES = 256 << 20
REPEATS = 3
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def resolve_crossovers(
    mode: str | None, overrides: str | None, model: Iterable[torch.nn.Module], world_size: int
) -> Crossovers:
    """The crossovers to serve with (installed by the caller); logs where they came from."""
    mode = mode or os.environ.get("RADIXSERVE_CPU_KERNEL_TUNING") or "auto"  # unresolved args
    extra = parse_overrides(overrides)
    if mode == "off":
        return DEFAULTS.with_overrides(extra)
    if world_size > 1:
        return Crossovers(source="defaults (multi-rank)").with_overrides(extra)
    layers = [
        m
        for module in model
        for m in module.modules()
        if isinstance(m, Linear) and m.weight_packed is not None
    ]
    if not layers:
        return DEFAULTS.with_overrides(extra)
    path = cache_path(layers)
    # One measurement at a time on this machine (DP replicas start together; two measuring at
    # once would each time the other's traffic): the others wait, then read what it cached.
    with _measurement_lock(path.parent):
        return _cached_or_measured(mode, path, layers).with_overrides(extra)


def _cached_or_measured(mode: str, path: Path, layers: list[Linear]) -> Crossovers:
    if mode == "auto" and path.exists():
        try:
            return _from_cache(path)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            logger.warning("CPU tuning cache %s unreadable (%s): measuring again", path, exc)
    busy = machine_busy()
    if mode == "auto" and busy:
        logger.info(
            "CPU kernel tuning: %s; serving with the default crossovers (a quiet start measures)", busy
        )
        return Crossovers(source="defaults (machine busy)")
    start = time.perf_counter()
    bounds, timings = measure(layers)
    measured = Crossovers(
        **bounds, source=f"measured in {time.perf_counter() - start:.1f} s, cached at {path}"
    )
    _store(path, measured, timings)
    return measured


@contextlib.contextmanager
def _measurement_lock(folder: Path) -> Iterator[None]:
    """An advisory lock file in the cache folder (no lock where the folder cannot be made)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / ".lock", "a")  # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tune_and_install(
    mode: str | None, overrides: str | None, model: Iterable[torch.nn.Module], world_size: int
) -> None:
    install(resolve_crossovers(mode, overrides, model, world_size))


def machine_busy() -> str:
    """Why the machine is too busy to measure on ('' when quiet): the 1-minute load average
    against the CPUs this process may use (our own start-up adds a fraction of one)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    cpus = available_cpus()
    return f"machine busy (load {load:.1f} on {cpus} CPUs)" if load > 0.75 * cpus else ""


# --- measurement ------------------------------------------------------------------------------


def measure(layers: list[Linear]) -> tuple[dict[str, int], dict[str, Any]]:
    """Each bound the model's forms have, from timed passes over its layers; the others keep
    their defaults. Returns (bounds, per-candidate timings in ms) for the cache and the log."""
    bounds, timings = DEFAULTS.bounds(), {}
    groups: dict[str, tuple[list[Linear], Callable[[Linear, torch.Tensor], torch.Tensor]]] = {
        "wq_max_tokens": (
            [m for m in layers if m.weight_wq is not None],
            lambda m, x: linear_wq(x, m.weight_wq, None),
        ),
        "f32_small_max_tokens": (
            [m for m in layers if m.weight_wq is None and m.weight_f16 is None and fusable(m.weight)],
            lambda m, x: cpu_kernels.linear_f32(x, m.weight, None),
        ),
        "f16_max_tokens": (
            [m for m in layers if m.weight_f16 is not None],
            lambda m, x: cpu_kernels.linear_f16(x, m.weight_f16, None),
        ),
    }
    for name, (members, small) in groups.items():
        members = _first_bytes(members, MAX_PASS_BYTES)
        if not members or (name != "wq_max_tokens" and not cpu_fused.ENABLED):
            continue
        bounds[name], timings[name] = _crossover(members, small, CANDIDATES[name])
    return bounds, timings


def _crossover(
    layers: list[Linear], small: Callable[[Linear, torch.Tensor], torch.Tensor], candidates: tuple[int, ...]
) -> tuple[int, dict[int, tuple[float, float]]]:
    """The last candidate before the small kernel loses twice in a row (one loss alone may be a
    disturbed pass; past two the GEMM has won), never below the first candidate."""
    best, losses, table = candidates[0], 0, {}
    for n in candidates:
        inputs = {m.in_features: torch.randn(n, m.in_features) for m in layers}
        t_small = _pass_ms(layers, inputs, small)
        t_gemm = _pass_ms(layers, inputs, _gemm)
        table[n] = (round(t_small, 3), round(t_gemm, 3))
        losses = losses + 1 if t_small > t_gemm else 0
        if losses == 2:
            break
        if not losses:
            best = n
    return best, table


def _gemm(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """What linear() runs above the small kernels' bounds: oneDNN over the packed weight."""
    if layer.weight_packed.dtype == torch.bfloat16:
        return _linear_bf16(x, layer.weight_packed, None)
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight_packed, None, "none", [], "")


def _pass_ms(
    layers: list[Linear], inputs: dict[int, torch.Tensor], fn: Callable[[Linear, torch.Tensor], torch.Tensor]
) -> float:
    """The fastest of REPEATS passes (after a warm-up) over every layer: the least disturbed."""
    times = []
    for i in range(REPEATS + 1):
        start = time.perf_counter()
        for m in layers:
            fn(m, inputs[m.in_features])
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def _first_bytes(layers: list[Linear], limit: int) -> list[Linear]:
    out, total = [], 0
    for m in layers:
        if total >= limit:
            break
        out.append(m)
        total += m.weight.numel() * m.weight.element_size()
    return out


# --- cache ------------------------------------------------------------------------------------


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


def cache_path(layers: list[Linear]) -> Path:
    key = json.dumps([cpu_identity(), model_identity(layers)], sort_keys=True).encode()
    return cache_dir() / f"{hashlib.sha256(key).hexdigest()[:24]}.json"


def _from_cache(path: Path) -> Crossovers:
    data = json.loads(path.read_text())
    bounds = {k: int(data["bounds"][k]) for k in Crossovers.BOUNDS}
    return Crossovers(**bounds, source=f"cached {data.get('measured_at', '?')} at {path}")


def _store(path: Path, crossovers: Crossovers, timings: dict[str, Any]) -> None:
    data = {
        "bounds": crossovers.bounds(),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_identity(),
        "timings_ms_small_vs_gemm": timings,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)  # atomic: two servers starting at once never read half a file
    except OSError as exc:
        logger.warning("CPU tuning: could not cache the crossovers at %s (%s)", path, exc)
