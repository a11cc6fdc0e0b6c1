"""One buffer for a decoder's int8-activation panels, in the order a decode step reads them.

At one token the fused decode stack (cpu_decode_runner) streams every linear's panels once a step
(~66 MB for the built-in model's Q4_1 decoder). pack_wq_a8 made each weight's q, scales and
offsets its own allocation: ~360 separate regions of 4 KB pages, each stream starting cold on a
new page, where the hardware prefetchers stop. Copied end to end in step order (each layer's qkv,
o, gate_up, down; per linear q, then scales, then offsets), one decode step reads one contiguous
region: on the issue's Zen 4 one thread ran the 120 linears 4-9% faster from the one buffer
(docs/cpu_backend.md, "One token (issue 40)"). The forms' panels become views of the buffer, so the
module forward reads the same bytes and no second copy stays in memory; the values are the same
bits, so every product is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from radixserve.layers.linear import Linear
from radixserve.model_executor.cpu_decode_moe import dense_mlp

ALIGN = 64  # bytes: each tensor starts on a cache line, as torch's own allocations do


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _parts(packed: object) -> list[torch.Tensor]:
    return [t for t in (packed.q, packed.scales, packed.offsets) if t is not None]


def gather_panels(linears: Sequence[Linear]) -> torch.Tensor | None:
    """Move the panels (GroupQuantWeight.a8_packed) of those of `linears` that have them into one
    uint8 buffer, in the given order, and point each Linear's form at views of it. Returns the
    buffer (the views keep it alive), or None when no linear has panels."""
    with_panels = [
        lin for lin in linears if lin.weight_wq is not None and lin.weight_wq.a8_packed is not None
    ]
    if not with_panels:
        return None
    sizes = [
        _aligned(t.numel() * t.element_size()) for lin in with_panels for t in _parts(lin.weight_wq.a8_packed)
    ]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8)
    at = 0
    for lin in with_panels:
        packed = lin.weight_wq.a8_packed
        views = {}
        for name in ("q", "scales", "offsets"):
            t = getattr(packed, name)
            if t is None:
                continue
            nbytes = t.numel() * t.element_size()
            view = buffer[at : at + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            views[name] = view
            at += _aligned(nbytes)
        lin.weight_wq = dataclasses.replace(lin.weight_wq, a8_packed=dataclasses.replace(packed, **views))
    return buffer


def step_order(layers: Sequence[torch.nn.Module]) -> list[Linear]:
    """A Llama-style decoder's linears in the order a decode step runs them (a MoE layer's MLP:
    its shared expert's, if any; its routed experts' panels are stacked apart)."""
    order = []
    for layer in layers:
        order += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        mlp = dense_mlp(layer)
        if mlp is not None:
            order += [mlp.gate_up_proj, mlp.down_proj]
    return order
