"""The expert path of a weight-only quantized MoE (a GGUF MoE) for this CPU: Crossovers.moe_a8.

Two paths serve such experts (layers/moe/layer.py): the exact one, fused_experts_grouped running
each routed expert's two projections through linear_wq on fp32 activations over the file's
integers; and the one-call kernel, moe_wq_a8_packed over every expert's 8-row panels on int8
activations (llama.cpp's Q8 activations; the quality cost is the documented one,
docs/quantization.md), the integers then kept only as panels (layers/moe/panel_forms.py). Which
is faster depends on the CPU, so the tuning (cpu_tuning.py) times both on a sample of the model's
own first MoE layer, at the token counts of a decode step at concurrency 1 and 16, and serves the
panels where they won at both. The sample's panels are made for the measurement and freed after.
The choice is cached with the other crossovers (same key, plus the experts' shapes and forms), so
it is deterministic given the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from radixserve.layers.moe import fused_moe_a8
from radixserve.layers.moe.fused_moe_a8 import experts_on_panels
from radixserve.layers.moe.fused_moe_cpu import fused_experts_grouped
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.quantized import DequantScratch, ExpertsWq, mark_int8_activations
from radixserve.model_executor.cpu_batch_numerics import fastest_ms

# Token counts timed: one decode step at concurrency 1 and at 16.
TOKENS = (1, 16)
# Experts a token is routed to in the measurement (Qwen3-30B-A3B's and Mixtral-style models' top-k
# is 2-8; the sample may hold fewer).
TOP_K = 8
# The sample: the first layer's experts up to this many bytes of forms (at least TOP_K of them),
# so successive passes route to experts the last pass did not read (less of it from cache).
SAMPLE_BYTES = 64 << 20
REPEATS = 3


def quantized_moes(model: Iterable[torch.nn.Module]) -> list[FusedMoE]:
    """The MoE layers served from weight-only quantized experts (none: the measurement is skipped)."""
    return [
        m
        for module in model
        for m in module.modules()
        if isinstance(m, FusedMoE) and m.experts_wq is not None and len(m.experts_wq.w13)
    ]


def moe_identity(moes: list[FusedMoE]) -> list[list[Any]]:
    """The experts' count, shapes and forms (part of the cache key: they move the choice)."""
    out = []
    for m in moes:
        w13, w2 = m.experts_wq.w13[0], m.experts_wq.w2[0]
        out.append(
            [
                len(m.experts_wq.w13),
                w13.out_features,
                w13.in_features,
                w2.out_features,
                w13.bits,
                w13.group_size,
            ]
        )
    return out


def measure_moe_a8(moes: list[FusedMoE]) -> tuple[bool, dict[int, tuple[float, float]]]:
    """(whether the panels won at every token count, {tokens: (exact ms, panels ms)}); (False, {})
    where there is nothing to measure or the kernel is not built."""
    if not moes or not fused_moe_a8.MOE_A8_KERNEL:
        return False, {}
    exact = _sample(moes[0].experts_wq)
    panels = mark_int8_activations(exact, panels=True)
    if panels.w13_panels is None:  # forms the panels cannot stack
        return False, {}
    num, top_k = len(exact.w13), min(TOP_K, len(exact.w13))
    meta13 = torch.empty(num, exact.w13[0].out_features, exact.w13[0].in_features, device="meta")
    meta2 = torch.empty(num, exact.w2[0].out_features, exact.w2[0].in_features, device="meta")
    scratch = DequantScratch()
    timings: dict[int, tuple[float, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for tokens in TOKENS:
        x = torch.randn(tokens, exact.w13[0].in_features, generator=gen)
        weights = torch.full((tokens, top_k), 1.0 / top_k)
        routes = [_route(tokens, top_k, num, i, gen) for i in range(REPEATS + 1)]
        exact_path = functools.partial(fused_experts_grouped, x, meta13, meta2, weights)
        t_exact = _best_ms(routes, lambda ids, run=exact_path: run(ids, None, exact, scratch))
        panel_path = functools.partial(experts_on_panels, x, weights)
        t_panels = _best_ms(routes, lambda ids, run=panel_path: run(ids, None, panels))
        timings[tokens] = (round(t_exact, 3), round(t_panels, 3))
    return all(p < e for e, p in timings.values()), timings


def _sample(wq: ExpertsWq) -> ExpertsWq:
    """The first experts of a layer up to SAMPLE_BYTES (at least TOP_K), unmarked: the exact path."""
    count, total = 0, 0
    while count < len(wq.w13) and (count < TOP_K or total < SAMPLE_BYTES):
        total += wq.w13[count].nbytes() + wq.w2[count].nbytes()
        count += 1

    def exact(form: Any) -> Any:  # noqa: ANN401 - GroupQuantWeight
        return dataclasses.replace(form, int8_activations=False, a8_packed=None)

    return ExpertsWq(
        tuple(exact(wq.w13[e]) for e in range(count)), tuple(exact(wq.w2[e]) for e in range(count))
    )


def _route(tokens: int, top_k: int, num: int, rotation: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens, top_k] expert ids: one token takes the rotation's block of top_k experts (so
    successive passes read different experts); more tokens draw theirs at random."""
    if tokens == 1:
        start = (rotation * top_k) % max(num - top_k + 1, 1)
        return torch.arange(start, start + top_k).unsqueeze(0)
    return torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(tokens)])


def _best_ms(routes: list[torch.Tensor], fn: Callable[[torch.Tensor], Any]) -> float:
    """The fastest of the timed passes (the first route is the warm-up): the least disturbed."""
    return fastest_ms(len(routes) - 1, lambda i: fn(routes[i]))
