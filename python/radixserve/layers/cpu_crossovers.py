"""The batch sizes at which `layers/linear.py` moves from one CPU weight form to the next.

Each bound is the largest number of tokens a small-batch kernel serves before oneDNN's GEMM over
the prepacked fp32 weight takes over. Where the crossover lies depends on the CPU (its vector
width, cache and memory bandwidth: a bound measured on one machine is wrong on another), so the
process holds one `Crossovers`, installed once at start: the static defaults below, or a short
measurement on this CPU and model (model_executor/cpu_tuning.py, cached per CPU and model).
Every reader calls `active()`; nothing else changes them while serving.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Crossovers:
    # A weight-only quantized layer (GGUF, int4/int8 weight-only) runs linear_wq over its integers
    # up to this many tokens; above, oneDNN over the exact fp32 dequantization. Default measured on
    # the built-in model's decoder (benchmark/bench_wq_linear.py, AVX-512, idle box): Q4_1
    # linear_wq beat oneDNN fp32 up to ~12 tokens (4.9 vs 8.6 ms at 2, 8.9 vs 11.0 at 8, 21.2 vs
    # 15.0 at 16); 8 left a margin.
    wq_max_tokens: int = 8
    # sgl-kernel's fp32 small-M kernel (streams the plain weight) up to this many tokens.
    f32_small_max_tokens: int = 2
    # --cpu-fp16-weights: sgl-kernel's fp16 kernel up to this many tokens.
    f16_max_tokens: int = 16
    # Weight-only forms whose groups are multiples of 32 inputs (GGUF, torchao) quantize their
    # activations to int8 per 32 inputs (linear_wq_a8, llama.cpp's Q8_0 x Q4/Q8 products) in
    # products of up to this many rows, on the module forward and in the fused decode alike; 0:
    # never (the exact fp32-activation product). Off by default: it changes outputs (slightly:
    # docs/quantization.md), so it is on only where this machine measured it faster
    # (cpu_tuning.py) or the user asked (--cpu-wq-int8-activations). Never above wq_max_tokens.
    wq_a8_max_tokens: int = 0
    # Not a bound but the numerics of the batches above wq_max_tokens: True runs a weight-only
    # layer's oneDNN GEMM over a bf16 copy of its dequantized weight (activations rounded to bf16
    # for that product, fp32 accumulation) instead of the exact fp32 one. Off by default (exact);
    # on where this CPU has native bf16 and measured it faster (cpu_batch_numerics.py), or with
    # --cpu-bf16-gemm. linear.use_bf16_batch_gemm repacks the layers to match.
    wq_batch_bf16: bool = False
    # Also the batches' numerics, for forms marked for int8 activations: True runs their batches
    # above wq_max_tokens as int8-activation GEMMs over 8-row panels (linear_wq_a8 on pack_wq_a8,
    # the VNNI GEMM tiles where built) instead of oneDNN's GEMM, and they keep no oneDNN copy.
    # Off by default; on where this CPU measured it faster than the fp32 and bf16 GEMMs
    # (cpu_batch_numerics.py) and int8 activations are not disabled. linear.use_a8_batch_panels
    # makes the panels to match. Small products keep wq_a8_max_tokens' choice.
    wq_batch_a8: bool = False
    # With wq_batch_a8: the largest batch that runs on those panels; 0 (the default) every batch,
    # and the forms keep no oneDNN copy. Measured (cpu_batch_numerics.a8_batch_bound) where the
    # panels won the decode batches' row counts but lost a prefill's by more than A8_BATCH_MAX_LOSS:
    # on an AVX2-only Zen 3 int8 products have no VNNI, and the panels ran 16- and 64-row batches
    # 2.15x faster than oneDNN's fp32 GEMM and a 512-row prefill 13% slower. Refusing them there
    # ran every decode batch on the slower GEMM; taking them everywhere slowed every prefill. So
    # the forms keep their oneDNN copy and batches above the bound (a prefill, a mixed chunk) use it.
    wq_batch_a8_max_tokens: int = 0
    # Where the batches did not choose those panels (wq_batch_a8 False) but int8 activations on
    # panels won the one-row timing (cpu_tuning.py times small products on the panels that would
    # serve, made for the timing): the marked forms get panels for their small products only
    # (rows <= wq_a8_max_tokens), and keep their oneDNN copy for the batches. The rule that maps
    # rows to a kernel is group_quant.a8_rows / wq_rows_bound. Off by default and under either
    # int8-activation flag (--cpu-wq-int8-activations' panels serve every row).
    wq_a8_small_panels: bool = False
    # A weight-only quantized MoE's experts (a GGUF MoE) serve every batch on int8 activations
    # from their stacked 8-row panels through one moe_wq_a8_packed call per layer, the forms' own
    # integers dropped (one resident copy: layers/moe/panel_forms.py). Off in the defaults (the
    # exact path, as the parity tests run); on where this CPU measured the one-call kernel faster
    # than the exact grouped path (model_executor/cpu_tuning_moe.py), or where the machine was
    # too busy to measure and the kernel is built (it won ~4x on every CPU measured), or with
    # --cpu-wq-int8-activations; --disable-cpu-wq-int8-activations keeps it off.
    moe_a8: bool = False
    # Where these came from ("defaults", "measured <when>", "cache <path>", "+ overrides"): logged.
    source: str = dataclasses.field(default="defaults", compare=False)

    BOUNDS = (
        "wq_max_tokens",
        "f32_small_max_tokens",
        "f16_max_tokens",
        "wq_a8_max_tokens",
        "wq_batch_a8_max_tokens",
    )
    # Bounds that may be 0 (the form is off; for wq_batch_a8_max_tokens: unbounded).
    MAY_BE_ZERO = ("wq_a8_max_tokens", "wq_batch_a8_max_tokens")

    def __post_init__(self) -> None:
        # int8 activations apply to linear_wq's products only: a bound above wq_max_tokens would
        # promise products that run oneDNN's fp32 GEMM.
        if self.wq_a8_max_tokens > self.wq_max_tokens:
            object.__setattr__(self, "wq_a8_max_tokens", self.wq_max_tokens)

    def bounds(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.BOUNDS}

    def with_overrides(self, overrides: dict[str, int]) -> Crossovers:
        if not overrides:
            return self
        return dataclasses.replace(self, **overrides, source=f"{self.source} + overrides {overrides}")

    def describe(self) -> str:
        bounds = ", ".join(f"{k}={v}" for k, v in self.bounds().items())
        batch = "bf16" if self.wq_batch_bf16 else "fp32"
        if self.wq_batch_a8:
            upto = self.wq_batch_a8_max_tokens
            rest = (
                f"up to {upto} rows (above, and unmarked forms: {batch})"
                if upto
                else f"(unmarked forms: {batch})"
            )
            batch = f"int8 activations on panels {rest}"
        elif self.wq_a8_small_panels and self.wq_a8_max_tokens:
            bounds += " (int8-activation products on panels)"
        experts = "int8 activations on panels" if self.moe_a8 else "exact (fp32 activations)"
        return (
            f"{bounds}, weight-only batch GEMMs in {batch}, quantized MoE experts {experts} ({self.source})"
        )


DEFAULTS = Crossovers()
_active = DEFAULTS


def active() -> Crossovers:
    """The crossovers this process runs with."""
    return _active


def install(crossovers: Crossovers) -> None:
    """Set once at start, before the first forward (and again only by a test that restores it)."""
    global _active
    _active = crossovers
    logger.info("CPU linear crossovers: %s", crossovers.describe())


def parse_overrides(text: str | None) -> dict[str, int]:
    """--cpu-kernel-crossovers '{"wq_max_tokens": 4}' -> the bounds it sets, checked."""
    if not text:
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--cpu-kernel-crossovers is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--cpu-kernel-crossovers must be a JSON object, e.g. '{\"wq_max_tokens\": 4}'")
    unknown = sorted(set(raw) - set(Crossovers.BOUNDS))
    if unknown:
        raise ValueError(
            f"--cpu-kernel-crossovers: unknown bound(s) {unknown}; known: {list(Crossovers.BOUNDS)}"
        )
    bad = {
        k: v
        for k, v in raw.items()
        if not isinstance(v, int) or isinstance(v, bool) or not _lowest(k) <= v <= 256
    }
    if bad:
        raise ValueError(
            f"--cpu-kernel-crossovers: bounds are token counts from 1 to 256 (wq_a8_max_tokens from 0: "
            f"off; wq_batch_a8_max_tokens from 0: unbounded), got {bad}"
        )
    return dict(raw)


def _lowest(bound: str) -> int:
    return 0 if bound in Crossovers.MAY_BE_ZERO else 1
