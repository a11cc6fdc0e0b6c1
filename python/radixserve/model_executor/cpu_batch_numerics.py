"""Whether a weight-only layer's batches (above wq_max_tokens) run oneDNN's bf16 GEMM or its fp32
one on this CPU: measured once per CPU and model by cpu_tuning.py, cached with the crossovers.

A weight-only quantized layer (GGUF, int4/int8 weight-only) keeps its exact fp32 dequantization
for oneDNN's GEMM at batch sizes where the small-batch kernel loses (decode at concurrency 16 and
up, prefill). On a CPU with native bf16 (AVX512_BF16 or AMX) oneDNN's bf16 GEMM over a bf16 copy
reads half the bytes and multiplies at twice the rate: activations are rounded to bf16 for those
products only, with fp32 accumulation (the numerics of a bf16 GPU, and of vLLM's CPU backend).
Elsewhere it would be emulated, so it is never measured there.

The choice: bf16 where its pass over the model's weight-only layers beat fp32's at every row
count in BATCH_ROWS (a decode step at concurrency 16 and 64), and where BF16_BY_DEFAULT says the
quality holds (docs/quantization.md). --cpu-bf16-gemm forces it, --disable-cpu-bf16-gemm keeps
fp32, and `--cpu-kernel-tuning off` keeps fp32 (the exact path the parity tests run).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from radixserve.layers.cpu_crossovers import Crossovers
from radixserve.layers.cpu_fused import cpu_kernels
from radixserve.layers.group_quant import WQ_A8_PACKED
from radixserve.layers.linear import Linear, _linear_bf16, bf16_gemm_supported, onednn_pack

# Rows of the products timed: decode steps at concurrency 16 and 64 (the batched cells).
BATCH_ROWS = (16, 64)
# Whether `--cpu-kernel-tuning auto` serves a measured bf16 choice (else it is measured and cached,
# but only --cpu-bf16-gemm turns it on). Decided by quality: docs/quantization.md's table.
BF16_BY_DEFAULT = True

# int8-activation batches are also timed at a prefill chunk's rows, over the first 1/PREFILL_SHARE
# of the layers' bytes (a pass then costs what one at 64 rows does).
PREFILL_ROWS = 512
PREFILL_SHARE = 8
# The most int8-activation batches may lose at one measured row count and still serve (a8_batches_win).
A8_BATCH_MAX_LOSS = 0.10
# Whether `--cpu-kernel-tuning auto` serves a measured int8-activation batch choice (else it is
# measured and cached, but not served). Decided by quality: docs/quantization.md's table.
A8_BATCH_BY_DEFAULT = True

PassMs = Callable[
    [list[Linear], dict[int, torch.Tensor], Callable[[Linear, torch.Tensor], torch.Tensor]], float
]


class Bf16Packs:
    """bf16 oneDNN copies of some layers' weights, made for a measurement only (the layers keep
    their fp32 packs until the choice is installed); called as the GEMM a batch would run."""

    def __init__(self, layers: list[Linear]) -> None:
        self.packs = {id(m): onednn_pack(m.weight, torch.bfloat16) for m in layers}

    def __call__(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return _linear_bf16(x, self.packs[id(layer)], None)


def fastest_ms(passes: int, run: Callable[[int], object]) -> float:
    """The fastest of run(1) .. run(passes) in ms, after run(0) as a warm-up: the least disturbed
    pass (the tuning's timings, cpu_tuning.py and cpu_tuning_moe.py)."""
    times = []
    for i in range(passes + 1):
        start = time.perf_counter()
        run(i)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def fp32_gemm(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """oneDNN's fp32 GEMM over the layer's fp32 pack (what the exact path runs)."""
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight_packed, None, "none", [], "")


def measure_bf16_batch(
    wq_layers: list[Linear], pass_ms: PassMs
) -> tuple[bool, Bf16Packs | None, dict[int, tuple[float, float]]]:
    """(whether bf16 won at every row count, the bf16 packs to measure wq_max_tokens against when
    it did, per row count (fp32, bf16) ms per pass). Nothing is measured without native bf16 or
    without weight-only layers packed in fp32."""
    layers = [m for m in wq_layers if m.weight_packed is not None and m.weight_packed.dtype == torch.float32]
    if not layers or not bf16_gemm_supported():
        return False, None, {}
    packs = Bf16Packs(layers)
    table = {}
    for n in BATCH_ROWS:
        inputs = {m.in_features: torch.randn(n, m.in_features) for m in layers}
        table[n] = (round(pass_ms(layers, inputs, fp32_gemm), 3), round(pass_ms(layers, inputs, packs), 3))
    won = all(bf16 < fp32 for fp32, bf16 in table.values())
    return won, (packs if won else None), table


def choose_bf16_batch(chosen: Crossovers, forced: bool | None) -> Crossovers:
    """The batch numerics to serve: the measured choice where BF16_BY_DEFAULT (fp32 otherwise),
    unless forced (--cpu-bf16-gemm: True, --disable-cpu-bf16-gemm: False)."""
    if forced is None:
        if BF16_BY_DEFAULT or not chosen.wq_batch_bf16:
            return chosen
        value, why = False, "bf16 batch GEMMs opt-in (measured faster)"
    else:
        value = forced
        why = "--cpu-bf16-gemm" if forced else "--disable-cpu-bf16-gemm"
    if value == chosen.wq_batch_bf16:
        return chosen
    return dataclasses.replace(chosen, wq_batch_bf16=value, source=f"{chosen.source}; {why}")


class A8Panels:
    """pack_wq_a8 panels of some marked layers' forms, made for a measurement only (the layers get
    theirs when the choice is installed: linear.use_a8_batch_panels); called as the product a batch
    would run (linear_wq_a8 on the panels: the VNNI GEMM tiles where built); a layer without
    panels (an unmarked form) runs `fallback`, the GEMM it keeps."""

    def __init__(
        self, layers: list[Linear], fallback: Callable[[Linear, torch.Tensor], torch.Tensor]
    ) -> None:
        self.fallback = fallback
        self.packs = {
            id(m): cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, w.bits, w.group_size)
            for m in layers
            for w in (m.weight_wq,)
        }

    def __call__(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if id(layer) not in self.packs:
            return self.fallback(layer, x)
        w = layer.weight_wq
        return cpu_kernels.linear_wq_a8(
            x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None, packed=self.packs[id(layer)]
        )


def measure_a8_batch(
    a8_layers: list[Linear], bf16: Bf16Packs | None, pass_ms: PassMs
) -> tuple[bool, A8Panels | None, dict[int, tuple[float, float]]]:
    """(whether int8 activations on panels beat the batch GEMM that would serve otherwise, bf16's
    packs where given, else fp32's, over the row counts of BATCH_ROWS and PREFILL_ROWS (a8_batches_win); the panels
    to measure wq_max_tokens against when they did; per row count (that GEMM, a8) ms per pass).
    Nothing is measured without marked layers packed for oneDNN or without the panel kernel."""
    layers = [m for m in a8_layers if m.weight_packed is not None and m.weight_packed.dtype == torch.float32]
    if not layers or not WQ_A8_PACKED:
        return False, None, {}
    gemm = bf16 if bf16 is not None else fp32_gemm
    panels = A8Panels(layers, gemm)
    total = sum(m.weight.numel() for m in layers)
    table = {}
    for n in (*BATCH_ROWS, PREFILL_ROWS):
        timed = layers if n != PREFILL_ROWS else _first_weights(layers, total // PREFILL_SHARE)
        inputs = {m.in_features: torch.randn(n, m.in_features) for m in timed}
        table[n] = (round(pass_ms(timed, inputs, gemm), 3), round(pass_ms(timed, inputs, panels), 3))
    won = a8_batches_win(table) or a8_batch_bound(table) > 0
    return won, (panels if won else None), table


def a8_batches_win(table: dict[int, tuple[float, float]]) -> bool:
    """Whether int8-activation batches serve, given per row count (the GEMM, a8) ms per pass:
    faster on the mean of the per-row-count ratios, and nowhere slower by more than
    A8_BATCH_MAX_LOSS. Not "faster at every row count": the first measurement on a quiet Zen 4
    timed the panels 32-40% faster at 16 and 64 rows and 5% slower at 512 (one noisy pass at a
    prefill's rows), and refusing them there cost a third of the batch throughput."""
    ratios = [a8 / other for other, a8 in table.values() if other > 0]
    if not ratios or len(ratios) != len(table):
        return False
    return sum(ratios) / len(ratios) < 1.0 and max(ratios) <= 1.0 + A8_BATCH_MAX_LOSS


def a8_batch_bound(table: dict[int, tuple[float, float]]) -> int:
    """The largest batch int8-activation panels serve (Crossovers.wq_batch_a8_max_tokens) given
    a8_batch's timings: 0 where they serve every batch (a8_batches_win) or none; the largest decode
    row count (BATCH_ROWS) where they won at every decode row count but lost a prefill's rows by
    more than A8_BATCH_MAX_LOSS. Then the forms keep their oneDNN copy for the larger batches: the
    memory of two forms for the speed of each where it is faster (an AVX2-only CPU, no VNNI)."""
    if not table or a8_batches_win(table):
        return 0
    decode = [table.get(n) for n in BATCH_ROWS]
    if any(t is None or t[0] <= 0 or t[1] >= t[0] for t in decode):
        return 0
    return max(BATCH_ROWS)


def _first_weights(layers: list[Linear], limit: int) -> list[Linear]:
    """The first layers, in model order, up to `limit` weights (at least one layer)."""
    out, total = [], 0
    for m in layers:
        if out and total + m.weight.numel() > limit:
            break
        out.append(m)
        total += m.weight.numel()
    return out


def choose_a8_batch(chosen: Crossovers, int8_forced: bool | None, bf16_forced: bool | None) -> Crossovers:
    """The int8-activation batch choice to serve: the measured one where A8_BATCH_BY_DEFAULT, off
    under --disable-cpu-wq-int8-activations (int8_forced False: the exact batches) and
    --cpu-bf16-gemm (bf16_forced True: the batches the flag asks for)."""
    if not chosen.wq_batch_a8:
        return chosen
    if int8_forced is False:
        why = "--disable-cpu-wq-int8-activations"
    elif bf16_forced:
        why = "--cpu-bf16-gemm"
    elif not A8_BATCH_BY_DEFAULT and not int8_forced:
        why = "int8-activation batches opt-in (measured faster)"
    else:
        return chosen
    # wq_a8_max_tokens was timed on the batches' panels: without them, the small products keep
    # panels of their own (wq_a8_small_panels), unless a flag decides int8 activations (forced
    # on, its own panels serve every row).
    small = int8_forced is None and chosen.wq_a8_max_tokens > 0
    return dataclasses.replace(
        chosen,
        wq_batch_a8=False,
        wq_batch_a8_max_tokens=0,
        wq_a8_small_panels=small,
        source=f"{chosen.source}; {why}",
    )
