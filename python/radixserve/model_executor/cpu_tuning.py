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

One bound is a choice of numerics, not only of speed: `wq_a8_max_tokens`, the largest product in
which weight-only forms quantize their activations to int8 (linear_wq_a8 against linear_wq, over
the model's own wq layers at 1, 2, 4 and 8 rows, on panels: the batches' where they chose them,
else panels made for the timing, which the layers then get for these products where they won,
wq_a8_small_panels; 0 where int8 activations lose at one row). `auto`
serves the measured bound only where A8_BY_DEFAULT says the quality holds (docs/cpu_backend.md);
`--cpu-wq-int8-activations` forces int8 activations on (the measured bound, or A8_MAX_ROWS where
none was measured) and `--disable-cpu-wq-int8-activations` forces them off (the exact product).

Another is `wq_batch_bf16`: whether weight-only layers' batches run oneDNN's bf16 GEMM instead of
the fp32 one (cpu_batch_numerics.py; measured first, since wq_max_tokens is then measured against
the GEMM that will serve). `--cpu-bf16-gemm` forces it on, `--disable-cpu-bf16-gemm` off.
And `wq_batch_a8`: whether the marked forms' batches run int8-activation GEMMs on their panels
instead (measured after bf16, against the GEMM it chose); `--disable-cpu-wq-int8-activations` and
`--cpu-bf16-gemm` keep it off.
And `moe_a8`: whether a weight-only quantized MoE's experts serve on their int8-activation panels
(one call per layer) instead of the exact grouped path (cpu_tuning_moe.py); the two flags force it
as they force wq_a8_max_tokens.
The cache is a JSON file per (CPU, model) in $RADIXSERVE_CPU_TUNING_DIR (default
~/.cache/radixserve/cpu_tuning; cpu_tuning_cache.py); delete it to measure again. Multi-rank runs use the defaults (each rank
would measure alone, and the ranks' fused decode paths must agree on their batch bounds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
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
from radixserve.layers.group_quant import (
    A8_MAX_ROWS,
    WQ_A8_KERNEL,
    WQ_A8_PACKED,
    WQ_KERNEL,
    linear_wq_reference,
)
from radixserve.layers.linear import (
    Linear,
    _linear_bf16,
    use_a8_batch_panels,
    use_a8_small_panels,
    use_bf16_batch_gemm,
)
from radixserve.layers.moe import fused_moe_a8
from radixserve.layers.moe.layer import FusedMoE
from radixserve.model_executor.cpu_batch_numerics import (
    A8Panels,
    a8_batch_bound,
    choose_a8_batch,
    choose_bf16_batch,
    fastest_ms,
    measure_a8_batch,
    measure_bf16_batch,
)
from radixserve.model_executor.cpu_tuning_cache import cache_path, read_cache, write_cache
from radixserve.model_executor.cpu_tuning_moe import measure_moe_a8, moe_identity, quantized_moes
from radixserve.utils.cpus import available_cpus, busy_cpus_now

logger = logging.getLogger(__name__)

TUNING_MODES = ("auto", "measure", "off")
# Token counts tried per bound, ascending; the bound is the last one where the small kernel still
# wins (and it never goes below the first: at one token each small kernel reads the fewest bytes).
CANDIDATES = {
    "wq_max_tokens": (1, 2, 4, 6, 8, 12, 16, 24, 32),
    "f32_small_max_tokens": (1, 2, 3, 4, 6, 8),
    "f16_max_tokens": (2, 4, 8, 12, 16, 24, 32),
    # int8 activations against fp32 ones, both linear_wq: never above the wq bound measured first.
    "wq_a8_max_tokens": (1, 2, 4, 8),
}
# Whether `--cpu-kernel-tuning auto` serves the measured int8-activation bound (else the bound is
# measured and cached, but only --cpu-wq-int8-activations uses it). Decided by quality: the
# built-in model's Q4_1 GGUF with int8 activations scored perplexity 34.967 against the exact
# path's 34.810 (+0.45%), greedy agreement 0.964 (benchmark/eval_quality.py, 2026-11-30,
# docs/quantization.md's quality table): the band the docs call keeping fp32's quality (torchao
# int8wo +0.4% / 0.960, llama.cpp's Q8_0 +0.6% / 0.978), so it is on where measured faster.
A8_BY_DEFAULT = True
# A pass reads at most this many bytes of weights (whole layers, in model order): past any
# last-level cache, so they stream from memory as in a real step, and bounded for big models.
MAX_PASS_BYTES = 256 << 20
REPEATS = 3
# Part of the cache key: a cache written before a choice was measured (v1: before wq_batch_bf16)
# (v2: before wq_batch_a8) is not read, so a quiet start measures the new choice instead of
# serving without it.


def resolve_crossovers(
    mode: str | None,
    overrides: str | None,
    model: Iterable[torch.nn.Module],
    world_size: int,
    int8_activations: bool | None = None,
    bf16_batch: bool | None = None,
) -> Crossovers:
    """The crossovers to serve with (installed by the caller); logs where they came from.
    int8_activations: True forces them on (--cpu-wq-int8-activations), False off
    (--disable-cpu-wq-int8-activations), None leaves wq_a8_max_tokens to the mode. bf16_batch:
    likewise for wq_batch_bf16 (--cpu-bf16-gemm, --disable-cpu-bf16-gemm)."""
    mode = mode or os.environ.get("RADIXSERVE_CPU_KERNEL_TUNING") or "auto"  # unresolved args
    extra = parse_overrides(overrides)
    chosen = choose_int8_activations(_resolve(mode, model, world_size), int8_activations)
    chosen = choose_a8_batch(choose_bf16_batch(chosen, bf16_batch), int8_activations, bf16_batch)
    return chosen.with_overrides(extra)


def _resolve(mode: str, model: Iterable[torch.nn.Module], world_size: int) -> Crossovers:
    model = list(model)
    if mode == "off":
        return DEFAULTS
    layers = [
        m
        for module in model
        for m in module.modules()
        if isinstance(m, Linear) and m.weight_packed is not None
    ]
    moes = quantized_moes(model)  # their expert path is measured too (cpu_tuning_moe.py)
    if world_size > 1:
        # Each rank would measure alone, and the ranks must agree: the unmeasured defaults, which
        # depend on the model and the build only, so every rank resolves the same.
        return unmeasured_defaults(layers, moes, "multi-rank")
    if not layers:
        return DEFAULTS
    path = cache_path(layers, moe_identity(moes))
    # One measurement at a time on this machine (DP replicas start together; two measuring at
    # once would each time the other's traffic): the others wait, then read what it cached.
    with _measurement_lock(path.parent):
        return _cached_or_measured(mode, path, layers, moes)


def choose_int8_activations(chosen: Crossovers, forced: bool | None) -> Crossovers:
    """The int8-activation bound to serve: the measured one where A8_BY_DEFAULT (0 otherwise),
    unless forced. Forced on, a bound of 0 (not measured, or int8 activations lost at one row
    here) becomes A8_MAX_ROWS: the flag means on."""
    if forced is False:
        bound, moe, why = 0, False, "--disable-cpu-wq-int8-activations"
    elif forced:
        # Every product: with batch panels (wq_batch_a8) a8_rows leaves the small ones to this bound.
        bound = chosen.wq_max_tokens if chosen.wq_batch_a8 else chosen.wq_a8_max_tokens or A8_MAX_ROWS
        moe, why = True, "--cpu-wq-int8-activations"
    elif A8_BY_DEFAULT or not (chosen.wq_a8_max_tokens or chosen.moe_a8):
        return chosen
    else:
        bound, moe, why = 0, False, f"int8 activations opt-in (measured bound {chosen.wq_a8_max_tokens})"
    if (bound, moe, False) == (chosen.wq_a8_max_tokens, chosen.moe_a8, chosen.wq_a8_small_panels):
        return chosen
    # Forced either way, no panels for the small products only: the flag's own panels serve every
    # row (group_quant.panels_serve_every_row), and off makes none.
    return dataclasses.replace(
        chosen,
        wq_a8_max_tokens=bound,
        moe_a8=moe,
        wq_a8_small_panels=False,
        source=f"{chosen.source}; {why}",
    )


def _cached_or_measured(mode: str, path: Path, layers: list[Linear], moes: list[FusedMoE]) -> Crossovers:
    if mode == "auto" and path.exists():
        try:
            return read_cache(path)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            logger.warning("CPU tuning cache %s unreadable (%s): measuring again", path, exc)
    busy = machine_busy()
    if mode == "auto" and busy:
        logger.info(
            "CPU kernel tuning: %s; serving with the default crossovers (a quiet start measures)", busy
        )
        return unmeasured_defaults(layers, moes, "machine busy")
    start = time.perf_counter()
    bounds, timings = measure(layers)
    bounds["moe_a8"], timings["moe_a8"] = measure_moe_a8(moes)
    measured = Crossovers(
        **bounds, source=f"measured in {time.perf_counter() - start:.1f} s, cached at {path}"
    )
    write_cache(path, measured, timings)
    return measured


def unmeasured_defaults(layers: list[Linear], moes: list[FusedMoE], why: str) -> Crossovers:
    """What a start that does not measure (`why`: too busy, or one rank of several) serves: the
    defaults, except for a weight-only quantized MoE. Its experts take the one-call kernel where it is built: it won ~4x over the exact path on
    every CPU measured (docs/benchmarks.md). And its marked dense layers (the LM head, 57% of a
    Qwen3-30B-A3B-shaped Q4_0 token's bytes) take int8 activations at one row on panels of their
    own: 1.9x the exact product on Zen 4, ~3x on Zen 1 (docs/cpu_backend.md, "One row"), the
    numerics its experts already have. Dense models keep the exact defaults."""
    if not (moes and fused_moe_a8.MOE_A8_KERNEL):
        return Crossovers(source=f"defaults ({why})")
    marked = any(m.weight_wq is not None and m.weight_wq.int8_activations for m in layers)
    one_row = 1 if marked and WQ_A8_PACKED else 0
    return Crossovers(
        source=f"defaults ({why})",
        moe_a8=True,
        wq_a8_max_tokens=one_row,
        wq_a8_small_panels=bool(one_row),
    )


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
    mode: str | None,
    overrides: str | None,
    model: Iterable[torch.nn.Module],
    world_size: int,
    int8_activations: bool | None = None,
    bf16_batch: bool | None = None,
) -> None:
    """Resolve the crossovers, install them, and repack the weight-only layers' batch copies in
    bf16 where they chose it."""
    model = list(model)
    chosen = resolve_crossovers(mode, overrides, model, world_size, int8_activations, bf16_batch)
    install(chosen)
    install_tuned_forms(model, chosen)


def install_tuned_forms(model: list[torch.nn.Module], chosen: Crossovers) -> None:
    """The weight forms `chosen` serves from (panels, bf16 batch copies), made on the layers that
    lack them: at start, and again when a weight update or a resume rebuilt the layers' derived
    forms from the weights (weight_sync.rebuild_derived), which would otherwise serve without them."""
    if chosen.wq_batch_a8:
        # First: the marked layers' oneDNN copies go (unless batches above a bound keep their
        # GEMM), so bf16 repacks only the others.
        use_a8_batch_panels(model, keep_gemm=chosen.wq_batch_a8_max_tokens > 0)
    elif chosen.wq_a8_small_panels and chosen.wq_a8_max_tokens:
        use_a8_small_panels(model)  # the oneDNN copies stay: the batches keep their GEMM
    if chosen.wq_batch_bf16:
        use_bf16_batch_gemm(model)


def machine_busy() -> str:
    """Why the machine is too busy to measure on ('' when quiet): other work keeping more than a
    quarter of this process's CPUs busy right now (busy_cpus_now), or a 1-minute load average
    above 3/4 of them (our own start-up adds a fraction of one). Both, because the costs are not
    alike: a measurement beside a neighbour caches wrong bounds for good, while calling a quiet
    machine busy only defers the measurement to a later start; and the load average alone trails
    by a minute or more, so it missed a neighbour that had just started."""
    cpus = available_cpus()
    now = busy_cpus_now()
    if now is not None and now > 0.25 * cpus:
        return f"machine busy ({now:.1f} of {cpus} CPUs busy with other work)"
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    return f"machine busy (load {load:.1f} on {cpus} CPUs)" if load > 0.75 * cpus else ""


# --- measurement ------------------------------------------------------------------------------


def measure(layers: list[Linear]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each bound the model's forms have, from timed passes over its layers; the others keep
    their defaults; and wq_batch_bf16. Returns (Crossovers fields, per-candidate timings in ms)
    for the cache and the log."""
    bounds, timings = DEFAULTS.bounds(), {}
    wq_layers = _first_bytes([m for m in layers if m.weight_wq is not None], MAX_PASS_BYTES)
    # The batch numerics first: wq_max_tokens is where linear_wq loses to the GEMM that will serve.
    bf16, bf16_gemm, timings["wq_batch_bf16"] = measure_bf16_batch(wq_layers, _pass_ms)
    # Then int8-activation panels against the winner of those two, for the marked layers.
    a8_layers = [m for m in wq_layers if m.weight_wq.int8_activations] if WQ_A8_KERNEL else []
    a8_batch, a8_gemm, timings["wq_batch_a8"] = measure_a8_batch(a8_layers, bf16_gemm, _pass_ms)
    if a8_gemm is not None:
        bf16_gemm = a8_gemm
        # Where the panels won the decode batches only, larger batches keep the GEMM (a8_batch_bound).
        bounds["wq_batch_a8_max_tokens"] = a8_batch_bound(timings["wq_batch_a8"])
    groups: dict[str, tuple[list[Linear], Callable[[Linear, torch.Tensor], torch.Tensor]]] = {
        "wq_max_tokens": ([m for m in layers if m.weight_wq is not None], _exact_wq),
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
        against = bf16_gemm if name == "wq_max_tokens" else None
        bounds[name], timings[name] = _crossover(members, small, CANDIDATES[name], against=against)
    a8 = _first_bytes(
        [m for m in layers if m.weight_wq is not None and m.weight_wq.int8_activations], MAX_PASS_BYTES
    )
    small_panels = False
    if a8 and WQ_A8_KERNEL:
        # Small int8-activation products are timed on what would serve them: panels (one row
        # takes their prefetched one-row path, csrc/cpu/wq_a8_one_row.h), the batches' where they
        # chose them, else panels made for this timing only, which the layers then get for their
        # small products where they won (wq_a8_small_panels). Timing linear_wq_a8 on the forms'
        # own tensors instead chose exact one-row products on Zen 4 although the panels ran them
        # ~1.9x faster (docs/cpu_backend.md, "One row"): a GGUF MoE's LM head then ran exact.
        panels = a8_gemm if a8_gemm is not None else _timing_panels(a8)
        small_a8 = _a8_wq if panels is None else _on_panels(panels)
        candidates = tuple(n for n in CANDIDATES["wq_a8_max_tokens"] if n <= bounds["wq_max_tokens"])
        bounds["wq_a8_max_tokens"], timings["wq_a8_max_tokens"] = _crossover(
            a8, small_a8, candidates, against=_exact_wq, floor=0
        )
        small_panels = a8_gemm is None and panels is not None and bounds["wq_a8_max_tokens"] > 0
    chosen = {"wq_batch_bf16": bf16, "wq_batch_a8": a8_batch, "wq_a8_small_panels": small_panels}
    return {**bounds, **chosen}, timings


def _timing_panels(layers: list[Linear]) -> A8Panels | None:
    """Panels of `layers` for the small products' timing (freed with it), or None without the
    panel kernel."""
    return A8Panels(layers, _exact_wq) if WQ_A8_PACKED else None


def _exact_wq(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """linear_wq with fp32 activations, whatever bounds are installed now."""
    w = layer.weight_wq
    if not WQ_KERNEL:
        return linear_wq_reference(x, w)
    return cpu_kernels.linear_wq(
        x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None, kernel_form=w.kernel_form
    )


def _on_panels(panels: A8Panels) -> Callable[[Linear, torch.Tensor], torch.Tensor]:
    """linear_wq_a8 on the measurement's panels of a layer, on its form's tensors where it has none
    (never the GEMM A8Panels falls back to: a small product would not run that)."""

    def run(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return panels(layer, x) if id(layer) in panels.packs else _a8_wq(layer, x)

    return run


def _a8_wq(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    w = layer.weight_wq
    return cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None)


def _crossover(
    layers: list[Linear],
    small: Callable[[Linear, torch.Tensor], torch.Tensor],
    candidates: tuple[int, ...],
    against: Callable[[Linear, torch.Tensor], torch.Tensor] | None = None,
    floor: int | None = None,
) -> tuple[int, dict[int, tuple[float, float]]]:
    """The last candidate before `small` loses to `against` (default: oneDNN's GEMM) twice in a
    row (one loss alone may be a disturbed pass; past two the other has won), never below `floor`
    (default: the first candidate; 0 for a form that may not pay at all)."""
    against = against or _gemm
    best, losses, table = candidates[0] if floor is None else floor, 0, {}
    for n in candidates:
        inputs = {m.in_features: torch.randn(n, m.in_features) for m in layers}
        t_small = _pass_ms(layers, inputs, small)
        t_other = _pass_ms(layers, inputs, against)
        table[n] = (round(t_small, 3), round(t_other, 3))
        losses = losses + 1 if t_small > t_other else 0
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

    def one_pass(_: int) -> None:
        for m in layers:
            fn(m, inputs[m.in_features])

    return fastest_ms(REPEATS, one_pass)


def _first_bytes(layers: list[Linear], limit: int) -> list[Linear]:
    out, total = [], 0
    for m in layers:
        if total >= limit:
            break
        out.append(m)
        total += m.weight.numel() * m.weight.element_size()
    return out
