"""Weight-only group-quantized linears (sgl-kernel's linear_wq) at the built-in model's decoder shapes.

    python benchmark/bench_wq_linear.py                       # M = 1 4 16
    python benchmark/bench_wq_linear.py --tokens 1 --repeats 50
    python benchmark/bench_wq_linear.py --lm-head-only --tokens 1 2 4 8 16
    python benchmark/bench_wq_linear.py --wq-only --threads 1 --tokens 1 2 4 5 8   # tile shapes

One decode step's decoder weights (30 layers of qkv / o / gate_up / down, each its own tensor so
they stream from memory as in a real step) in two weight-only forms:

- Q4_1-like: 4-bit integers, an fp32 scale and offset per group of 32 inputs (0.75 bytes/weight);
- Q8_0-like: 8-bit integers, an fp32 scale per group of 32 inputs (1.125 bytes/weight);

each through linear_wq on its AVX-512 and AVX2 paths (each path the machine has; "f16 groups": the
same form with fp16 scales and offsets, what the fused decode stack reads for GGUF forms) and through
linear_wq_a8 (int8 activations per 32 inputs, "a8": what --cpu-wq-int8-activations and a measured
wq_a8_max_tokens run; its best compiled path), against a plain
read of the same bytes (torch's amax over one buffer of each linear's size, viewed as int32: what
the memory gives), and the forms the model serves otherwise: sgl-kernel's linear_f32, linear_f16
and linear_int8 (W8A8, per-channel), and oneDNN over prepacked fp32 weights (what wq layers run
above WQ_MAX_TOKENS tokens: the crossover tells where that bound belongs). The LM head (49,152 x 576, Q8_0 in the built-in GGUF) is
timed on its own, as 3 copies called in turn: one copy (21-32 MB in these forms) would stay in a
32 MB L3 between calls, which a real step (the decoder's weights streamed in between) never sees.

Per M: ms per step (median of --repeats after a warm-up) and GB/s over each form's own bytes;
for the linear_wq paths also the share of the plain read's GB/s (the issue's goal: >= 85% at M=1).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import SimpleNamespace

import torch
from bench_cpu_kernels import HIDDEN, LAYERS, LINEAR_SHAPES, VOCAB, median_ms

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from radixserve.layers.quantization import quantize_weight_int8
from radixserve.model_executor.cpu_decode_runner import KERNEL_TAKES_HALF_GROUPS
from sgl_kernel import cpu as cpu_kernels

# name -> (bits, group_size, offsets)
WQ_FORMATS = {"Q4_1-like": (4, 32, True), "Q8_0-like": (8, 32, False)}


def random_wq(n: int, k: int, bits: int, group: int, offsets: bool) -> GroupQuantWeight:
    """A weight of that form with random integers and scales (the values do not change the speed)."""
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k)))
    else:
        qweight = torch.randint(-128, 128, (n, k)).to(torch.int8)
    scales = torch.rand(n, k // group) * 0.01
    return GroupQuantWeight(
        qweight, scales, torch.rand(n, k // group) - 0.5 if offsets else None, group, bits
    )


def half_groups_form(w: GroupQuantWeight) -> SimpleNamespace:
    """w with fp16 scales and offsets (rounded through fp16: the values do not change the speed),
    as cpu_decode_runner.half_groups gives the fused decode stack for GGUF forms."""
    scales = w.scales.half()
    offsets = None if w.offsets is None else w.offsets.half()
    nbytes = w.qweight.numel() + 2 * scales.numel() + (0 if offsets is None else 2 * offsets.numel())
    return SimpleNamespace(
        qweight=w.qweight, scales=scales, offsets=offsets, bits=w.bits, group_size=w.group_size, nbytes=nbytes
    )


def plain_read(weights: list[GroupQuantWeight], repeats: int) -> float:
    """ms to read the same bytes, one contiguous buffer per linear (as many tensors as the kernel)."""
    words = [torch.randint(-(2**31), 2**31 - 1, (w.nbytes() // 4,), dtype=torch.int32) for w in weights]
    return median_ms(lambda: [b.amax() for b in words], repeats)


def _wq_fn(isa: str) -> Callable:
    def run(x: torch.Tensor, w: GroupQuantWeight) -> torch.Tensor:
        return cpu_kernels.linear_wq(x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None, isa)

    return run


def _wq_a8(x: torch.Tensor, w: GroupQuantWeight) -> torch.Tensor:
    return cpu_kernels.linear_wq_a8(x, w.qweight, w.scales, w.offsets, w.bits, w.group_size)


def forms(
    flat: list[torch.Tensor], shapes: list[tuple[int, int]], wq_only: bool = False
) -> dict[str, tuple[Callable, list, float]]:
    """name -> (fn(x, weight_form), weight forms, bytes per weight)."""
    out: dict[str, tuple[Callable, list, float]] = {}
    for name, (bits, group, offsets) in WQ_FORMATS.items():
        weights = [random_wq(n, k, bits, group, offsets) for n, k in shapes]
        per_weight = sum(w.nbytes() for w in weights) / sum(n * k for n, k in shapes)
        halves = [half_groups_form(w) for w in weights] if KERNEL_TAKES_HALF_GROUPS else []
        per_weight_half = sum(h.nbytes for h in halves) / sum(n * k for n, k in shapes)
        for isa in ("avx512", "avx2"):
            if isa in cpu_kernels.linear_wq_isas():
                out[f"{name} {isa}"] = (_wq_fn(isa), weights, per_weight)
                if halves:  # what the fused decode stack reads (GGUF's fp16 d and m)
                    out[f"{name} {isa} f16 groups"] = (_wq_fn(isa), halves, per_weight_half)
        if cpu_kernels.linear_wq_a8_isas():
            out[f"{name} a8"] = (_wq_a8, weights, per_weight)
    if wq_only:
        return out
    out["linear_f32"] = (cpu_kernels.linear_f32, flat, 4)
    out["linear_f16"] = (cpu_kernels.linear_f16, [w.half() for w in flat], 2)
    if cpu_kernels.linear_int8_isas():
        int8 = [quantize_weight_int8(w) for w in flat]
        out["linear_int8"] = (lambda x, ws: cpu_kernels.linear_int8(x, ws[0], ws[1]), int8, 1)
    # What fp32 batches above 2 tokens run (and wq batches above WQ_MAX_TOKENS): the bound to tune.
    out["oneDNN fp32 prepacked"] = (
        lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in flat],
        4,
    )
    return out


def bench(title: str, shapes: list[tuple[int, int]], tokens: list[int], repeats: int, wq_only: bool) -> None:
    flat = [] if wq_only else [torch.randn(n, k) * 0.05 for n, k in shapes]
    params = sum(n * k for n, k in shapes)
    table = forms(flat, shapes, wq_only)
    reads = {}
    for name in WQ_FORMATS:
        weights = next(ws for key, (_, ws, _) in table.items() if key.startswith(name))
        nbytes = sum(w.nbytes() for w in weights)
        ms = plain_read(weights, repeats)
        reads[name] = nbytes / ms / 1e6
        print(
            f"{title}: plain read of the {name} bytes ({nbytes / 1e6:.1f} MB): {ms:.2f} ms, {reads[name]:.1f} GB/s"
        )
    print(f"{'M':>4} " + " ".join(f"{name:>30}" for name in table))
    in_features = [k for _, k in shapes]
    for m in tokens:
        xs = {k: torch.randn(m, k) for k in set(in_features)}
        inputs = [xs[k] for k in in_features]
        cells = []
        for name, (fn, weights, per_weight) in table.items():
            ms = median_ms(
                lambda fn=fn, weights=weights, inputs=inputs: [fn(x, w) for x, w in zip(inputs, weights)],
                repeats,
            )
            gbs = params * per_weight / ms / 1e6
            read = next((r for fmt, r in reads.items() if name.startswith(fmt)), None)
            share = f" {100 * gbs / read:3.0f}%" if read else ""
            cells.append(f"{ms:6.2f} ms {gbs:5.1f} GB/s{share}")
        print(f"{m:>4} " + " ".join(f"{c:>30}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-lm-head", action="store_true", help="only the decoder layers")
    parser.add_argument(
        "--wq-only", action="store_true", help="only linear_wq's paths (tile-shape comparisons)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--lm-head-only",
        action="store_true",
        help="only the LM head (w8a8_int8's head: the Q8_0-like form against linear_int8 and the fp32/fp16 ones)",
    )
    args = parser.parse_args()
    if not cpu_kernels.linear_wq_isas():
        raise SystemExit(
            "sgl_kernel._cpu is not built with linear_wq (pip install --no-build-isolation -e sgl-kernel)"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, linear_wq paths: {cpu_kernels.linear_wq_isas()}")
    if not args.lm_head_only:
        bench(
            f"decoder ({LAYERS} layers)",
            [s for _ in range(LAYERS) for s in LINEAR_SHAPES],
            args.tokens,
            args.repeats,
            args.wq_only,
        )
    if not args.no_lm_head:
        bench("LM head (3 copies)", [(VOCAB, HIDDEN)] * 3, args.tokens, args.repeats, args.wq_only)


if __name__ == "__main__":
    main()
