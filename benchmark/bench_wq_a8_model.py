"""bench_wq_a8.py --model builtin: one decode step of the built-in model's int8-activation panels
(what --cpu-wq-int8-activations serves) per code path, against the machine's read bandwidth.

The step: the 30 decoder layers' qkv / o / gate_up / down (each its own panels, so they stream
from memory as in a real step) in the given GGUF type, then the LM head (49,152 x 576, Q8_0 as
the built-in GGUF has it) as its own row. Per M and isa: ms per step (median of --repeats; thread
CPU time on one thread, wall time on more), GB/s over the panels' bytes, and that as a share of what torch's sum reads per
second from a 0.5 GiB tensor (profile_moe_decode.py's bandwidth_gbs, wall time): the
bytes-per-token bound (issue #40 asks >= 85% at one token); and as a share of a plain read of as
many bytes in as many tensors on the same clock (what a shared machine distorts least). The Python loop's calls (~120 a step) are in the time, as
the model's own per-linear dispatch is in a real step's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from bench_cpu_kernels import HIDDEN, LAYERS, LINEAR_SHAPES, VOCAB
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


def _median_ms(step: Callable[[], None], repeats: int) -> float:
    """Median ms of `step` after a warm-up: the thread's own CPU time on one thread (a shared
    machine inflates wall time far more), wall time when torch runs more threads."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    step()
    times = []
    for _ in range(repeats):
        start = clock()
        step()
        times.append((clock() - start) * 1e3)
    return statistics.median(times)


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
    # The same bytes read plainly (one int32 buffer per linear, amax), on the same clock.
    words = [torch.ones(p.nbytes() // 4, dtype=torch.int32) for p in packs]
    plain_ms = _median_ms(lambda: [w.amax() for w in words], repeats)
    print(
        f"\n{title}: {len(forms)} linears, {nbytes / 1e6:.1f} MB of panels; a plain read of as many "
        f"bytes: {plain_ms:.2f} ms, {nbytes / plain_ms / 1e6:.1f} GB/s"
    )
    print(f"  {'M':>3} " + " ".join(f"{isa + ' (% bandwidth, % plain read)':>38}" for isa in isas))
    for m in tokens:
        cells = []
        for isa in isas:
            ms = _median_ms(_step(forms, packs, m, isa), repeats)
            gbs = nbytes / ms / 1e6
            cells.append(
                f"{ms:6.2f} ms {gbs:5.1f} GB/s {100 * gbs / read_gbs:3.0f}% {100 * plain_ms / ms:3.0f}%"
            )
        print(f"  {m:>3} " + " ".join(f"{c:>38}" for c in cells))


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
    # What each row's time holds besides the products: 120 calls' Python, binding and dispatch.
    tiny = [make_form(8, 32, "Q8_0") for _ in range(LAYERS * len(LINEAR_SHAPES))]
    tiny_packs = [cpu_kernels.pack_wq_a8(f.qweight, f.scales, f.offsets, f.bits, f.group_size) for f in tiny]
    overhead = _median_ms(_step(tiny, tiny_packs, 1, "auto"), repeats)
    print(
        f"{len(tiny)} calls of an 8 x 32 linear (the per-call cost in every decoder row): {overhead:.2f} ms"
    )
    for type_name in types:
        forms = [make_form(n, k, type_name) for _ in range(LAYERS) for n, k in LINEAR_SHAPES]
        _table(f"decoder {type_name}", forms, tokens, isas, repeats, read_gbs)
    _table("LM head Q8_0", [make_form(VOCAB, HIDDEN, "Q8_0")], tokens, isas, repeats, read_gbs)
