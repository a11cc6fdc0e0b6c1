"""One decode token (M = 1) through the built-in model's 30 decoder layers of Q4_1-like linears
(qkv / o / gate_up / down, each its own tensor so they stream from memory as in a real step):
linear_wq with fp32 scales and offsets against the same form with fp16 ones (what the fused decode
stack reads for GGUF forms: cpu_decode_runner.half_groups), and linear_wq_a8 on the same form's
8-row panels (int8 activations: the one-row path of csrc/cpu/wq_a8_one_row.h), each beside two plain
reads of as many bytes: in as many tensors (what the kernels' own streams could get), and in one
contiguous tensor (the machine's read bound: issue 40's goal is >= 85% of it), alternated --rounds
times on the same clock. For the panels two more lines split the loss: "one linear" (a single
panel stack of the same bytes: one call, one stream a thread) and "in cache" (layer 0's four
linears 30 times: the kernel's arithmetic speed without memory).

    python benchmark/bench_one_row.py                      # one thread, thread CPU time
    python benchmark/bench_one_row.py --threads 2          # wall time

One thread is timed by the thread's CPU time (time.thread_time: what a shared machine does to the
wall clock is left out, its memory traffic is not), more by the wall clock. Per round and form: the
median ms of --repeats passes and the shares of the two plain reads' GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_cpu_kernels import HIDDEN, LAYERS, LINEAR_SHAPES
from bench_wq_linear import half_groups_form, random_wq

from sgl_kernel import cpu as cpu_kernels


def timed_ms(step: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = clock()
        step()
        times.append(clock() - start)
    return 1e3 * statistics.median(times)


def _one(xs: dict[int, torch.Tensor], w: object) -> torch.Tensor:
    """One linear at one row: linear_wq on a form, or linear_wq_a8 on a (form, panels) pair."""
    if isinstance(w, tuple):
        form, panels = w
        x = xs[form.in_features]
        return cpu_kernels.linear_wq_a8(
            x, form.qweight, form.scales, form.offsets, 4, 32, None, packed=panels
        )
    return cpu_kernels.linear_wq(xs[w.qweight.shape[1] * 2], w.qweight, w.scales, w.offsets, 4, 32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    shapes = [s for _ in range(LAYERS) for s in LINEAR_SHAPES]
    fp32 = [random_wq(n, k, 4, 32, True) for n, k in shapes]
    forms = {"fp32 groups": (fp32, [w.nbytes() for w in fp32])}
    halves = [half_groups_form(w) for w in fp32]
    forms["fp16 groups"] = (halves, [h.nbytes for h in halves])
    if cpu_kernels.linear_wq_a8_packed_available():
        panels = [cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, 4, 32) for w in fp32]
        forms["a8 panels"] = (list(zip(fp32, panels)), [p.nbytes() for p in panels])
    xs = {k: torch.randn(1, k) for _, k in shapes}
    print(
        f"{args.threads} thread(s), {'thread CPU' if args.threads == 1 else 'wall'} time, M=1, Q4_1-like decoder"
    )
    if "a8 panels" in forms:
        forms |= _panel_splits(forms["a8 panels"])
    for r in range(args.rounds):
        for name, (weights, sizes) in forms.items():
            words = [torch.empty(b // 4, dtype=torch.int32).random_() for b in sizes]
            whole = torch.empty(sum(sizes) // 4, dtype=torch.int32).random_()
            read = timed_ms(lambda words=words: [w.amax() for w in words], args.repeats, clock)
            bound = timed_ms(whole.amax, args.repeats, clock)
            run = timed_ms(lambda weights=weights: [_one(xs, w) for w in weights], args.repeats, clock)
            mb = sum(sizes) / 1e6
            print(
                f"round {r}: {name:12} {mb:5.1f} MB  linear_wq {run:6.2f} ms ({mb / run:5.1f} GB/s)  "
                f"plain read {read:6.2f} ms ({mb / read:5.1f} GB/s, share {100 * read / run:3.0f}%)  "
                f"contiguous {bound:6.2f} ms ({mb / bound:5.1f} GB/s, share {100 * bound / run:3.0f}%)",
                flush=True,
            )


def _panel_splits(panels: tuple[list, list[int]]) -> dict[str, tuple[list, list[int]]]:
    """The a8 panels' two splitting forms: one linear of about the same bytes (K = HIDDEN, rows to
    match), and layer 0's linears 30 times (their bytes stay in cache after the first pass)."""
    pairs, sizes = panels
    n = sum(sizes) // sizes[1] * HIDDEN // 8 * 8  # o_proj is [HIDDEN, HIDDEN]
    w = random_wq(n, HIDDEN, 4, 32, True)
    big = cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, 4, 32)
    first = len(LINEAR_SHAPES)
    return {
        "one linear": ([(w, big)], [big.nbytes()]),
        "in cache": (pairs[:first] * LAYERS, sizes[:first] * LAYERS),
    }


if __name__ == "__main__":
    main()
