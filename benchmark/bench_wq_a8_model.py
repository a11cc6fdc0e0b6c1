"""bench_wq_a8.py --model builtin: one decode step of the built-in model's int8-activation panels
(what --cpu-wq-int8-activations serves) per code path, against the machine's read bandwidth.

The step: the 30 decoder layers' qkv / o / gate_up / down (each its own panels, so they stream
from memory as in a real step) in the given GGUF type, then the LM head (49,152 x 576, Q8_0 as
the built-in GGUF has it) as its own row. Per M and isa: wall ms per step (median of --repeats,
torch's threads), GB/s over the panels' bytes, and that as a share of what torch's sum reads per
second from a 0.5 GiB tensor (profile_moe_decode.py's bandwidth_gbs): the bytes-per-token bound
(issue #40 asks >= 85% at one token). The Python loop's calls (~120 a step) are in the time, as
the model's own per-linear dispatch is in a real step's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from bench_cpu_kernels import HIDDEN, LAYERS, LINEAR_SHAPES, VOCAB, median_ms
from profile_moe_decode import bandwidth_gbs

from radixserve.layers.group_quant import GroupQuantWeight
from sgl_kernel import cpu as cpu_kernels


def _step(
    forms: list[GroupQuantWeight], packs: list[cpu_kernels.WqA8Packed], m: int, isa: str
) -> Callable[[], None]:
    """One pass over every form on its panels with M rows of x (one x per input width)."""
    xs = {k: torch.randn(m, k) for k in {f.in_features for f in forms}}

    def run() -> None:
        for f, p in zip(forms, packs):
            cpu_kernels.linear_wq_a8(
                xs[f.in_features], f.qweight, f.scales, f.offsets, f.bits, f.group_size, isa=isa, packed=p
            )

    return run


def _table(
    title: str,
    forms: list[GroupQuantWeight],
    tokens: list[int],
    isas: list[str],
    repeats: int,
    read_gbs: float,
) -> None:
    packs = [cpu_kernels.pack_wq_a8(f.qweight, f.scales, f.offsets, f.bits, f.group_size) for f in forms]
    nbytes = sum(p.nbytes() for p in packs)
    print(f"\n{title}: {len(forms)} linears, {nbytes / 1e6:.1f} MB of panels")
    print(f"  {'M':>3} " + " ".join(f"{isa:>30}" for isa in isas))
    for m in tokens:
        cells = []
        for isa in isas:
            ms = median_ms(_step(forms, packs, m, isa), repeats)
            gbs = nbytes / ms / 1e6
            cells.append(f"{ms:6.2f} ms {gbs:5.1f} GB/s {100 * gbs / read_gbs:3.0f}%")
        print(f"  {m:>3} " + " ".join(f"{c:>30}" for c in cells))


def bench_builtin(
    make_form: Callable[[int, int, str], GroupQuantWeight],
    types: list[str],
    tokens: list[int],
    isas: list[str],
    repeats: int,
) -> None:
    """The built-in model's decoder per type in `types`, then its Q8_0 LM head, per isa."""
    if not cpu_kernels.linear_wq_a8_packed_available():
        raise SystemExit("no int8-activation panel kernel in this build")
    threads = torch.get_num_threads()
    read_gbs, _ = bandwidth_gbs(threads, gib=0.5)
    torch.set_num_threads(threads)
    print(f"{threads} thread(s); read bandwidth (a 0.5 GiB sum): {read_gbs:.1f} GB/s; % = share of it")
    for type_name in types:
        forms = [make_form(n, k, type_name) for _ in range(LAYERS) for n, k in LINEAR_SHAPES]
        _table(f"decoder {type_name}", forms, tokens, isas, repeats, read_gbs)
    _table("LM head Q8_0", [make_form(VOCAB, HIDDEN, "Q8_0")], tokens, isas, repeats, read_gbs)
