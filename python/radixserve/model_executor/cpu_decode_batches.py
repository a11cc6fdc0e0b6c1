"""Which decode batches the fused CPU stack (cpu_decode_runner.py) takes above the small bound.

Below `wq_max_tokens` every weight-only layer runs linear_wq (or linear_wq_a8) on both paths. Above
it the module forward runs each layer as group_quant.wq_kernel says: oneDNN ("gemm") for a form
that kept its oneDNN copy, the int8-activation panels ("a8") for a form whose batches this CPU's
tuning put on them (Crossovers.wq_batch_a8) or whose panels serve every row
(--cpu-wq-int8-activations). The stack has no oneDNN GEMM in it, so it takes the larger batches
only where every decoder linear says "a8" there: then both paths run linear_wq_a8_packed on the
same rows of the same panels, and a batched step is one compiled call instead of ~15 Python-level
ops a layer whose gaps let the OpenMP workers fall asleep between parallel regions (issue 40).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixserve.layers.cpu_crossovers import active as crossovers
from radixserve.layers.group_quant import has_panels, wq_kernel, wq_rows_bound


def decoder_linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A decoder layer's four linears, in the fused stack's order (qkv, o, gate_up, down)."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def batches_on_panels(layers: Iterable[torch.nn.Module]) -> bool:
    """Whether every decoder linear runs every batch above wq_max_tokens on its int8-activation
    panels. wq_kernel is the same for every row count above wq_max_tokens (a8_rows is either at
    most wq_max_tokens or unbounded, a8_batch asks only rows > wq_max_tokens), so one row count
    above it decides them all."""
    rows = crossovers().wq_max_tokens + 1
    for layer in layers:
        if not hasattr(layer.mlp, "gate_up_proj"):
            # A MoE layer (cpu_decode_moe.py): the stack's MoE block was built and tested for the
            # small bound's batches; larger ones keep the module forward.
            return False
        for lin in decoder_linears(layer):
            w = getattr(lin, "weight_wq", None)
            if w is None or not has_panels(w) or wq_kernel(w, rows) != "a8":
                return False
    return True


def fused_batch_bound(
    layers: list[torch.nn.Module], max_decode_batch: int, single_rank: bool, with_lora: bool
) -> int:
    """The largest decode batch the stack takes for a weight-only quantized model: the largest
    decode batch there is (`max_decode_batch`, the request pool's rows: max_running_requests can
    be raised live up to it, so it bounds every decode batch) where every linear's batches run on
    panels, else wq_max_tokens (the module forward's oneDNN batches stay there). One rank without
    LoRA only: the shared-memory all-reduce and the compiled LoRA delta were measured and tested
    at the small bound's sizes, and those batches keep the module forward as before."""
    small = crossovers().wq_max_tokens
    if max_decode_batch <= small or not single_rank or with_lora or not batches_on_panels(layers):
        return small
    # Batches above the panels' bound (Crossovers.wq_batch_a8_max_tokens) run oneDNN's GEMM on the
    # module forward, which this stack has not.
    return min(max_decode_batch, panel_rows(layers))


def panel_rows(layers: Iterable[torch.nn.Module]) -> int:
    """The largest batch every decoder linear of `layers` runs on its panels (group_quant.wq_rows_bound)."""
    small = crossovers().wq_max_tokens
    return min(wq_rows_bound(lin.weight_wq, small) for layer in layers for lin in decoder_linears(layer))
