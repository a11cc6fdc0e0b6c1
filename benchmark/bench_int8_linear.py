"""The W8A8 int8 linear (sgl-kernel's linear_int8) at the built-in model's decoder shapes.

    python benchmark/bench_int8_linear.py                       # M = 1 2 4 8 16 64 256
    python benchmark/bench_int8_linear.py --tokens 1 --repeats 50

One decode step's decoder weights (30 layers of qkv / o / gate_up / down, each its own tensor so
they stream from memory as in a real step; the LM head stays fp32 under --quantization and is
left out) through:

- a plain read of the int8 bytes (torch's amax over them viewed as int32): what the memory gives;
- sgl-kernel's linear_int8 on its AVX-512 VNNI and AVX2 paths (each path the machine has);
- the fp32 and fp16 forms the model serves otherwise: sgl-kernel's linear_f32 and linear_f16, and
  oneDNN over prepacked fp32 weights (what fp32 batches above 2 tokens use).

Per M: ms per step (median of --repeats after a warm-up) and GB/s over each form's own weight
bytes, and for the int8 paths the share of the plain read's GB/s.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_cpu_kernels import HIDDEN, INTERMEDIATE, LAYERS, LINEAR_SHAPES, median_ms

from radixserve.layers.quantization import quantize_weight_int8
from sgl_kernel import cpu as cpu_kernels


def _forms(flat: list[torch.Tensor]) -> dict[str, tuple[Callable, list, int]]:
    """name -> (fn(x, weight_form), weight forms, bytes per weight)."""
    int8 = [quantize_weight_int8(w) for w in flat]
    forms: dict[str, tuple[Callable, list, int]] = {}
    for isa in ("avx512", "avx2"):
        if isa in cpu_kernels.linear_int8_isas():
            fn = lambda x, ws, isa=isa: cpu_kernels.linear_int8(x, ws[0], ws[1], None, isa)  # noqa: E731
            forms[f"linear_int8 {isa}"] = (fn, int8, 1)
    forms["linear_f32"] = (cpu_kernels.linear_f32, flat, 4)
    forms["linear_f16"] = (cpu_kernels.linear_f16, [w.half() for w in flat], 2)
    forms["oneDNN fp32 prepacked"] = (
        lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in flat],
        4,
    )
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not cpu_kernels.linear_int8_isas():
        raise SystemExit(
            "sgl_kernel._cpu is not built with linear_int8 (pip install --no-build-isolation -e sgl-kernel)"
        )
    torch.manual_seed(0)
    flat = [torch.randn(n, k) * 0.05 for _ in range(LAYERS) for n, k in LINEAR_SHAPES]
    params = sum(w.numel() for w in flat)
    forms = _forms(flat)
    int8_words = [quantize_weight_int8(w)[0].view(torch.int32) for w in flat]
    read_ms = median_ms(lambda: [w.amax() for w in int8_words], args.repeats)
    read_gbs = params / read_ms / 1e6
    print(
        f"decoder weights of one step: {params / 1e6:.1f} M parameters ({params / 1e6:.0f} MB int8), "
        f"{torch.get_num_threads()} threads, int8 paths: {cpu_kernels.linear_int8_isas()}"
    )
    print(f"plain read of the int8 bytes: {read_ms:.2f} ms, {read_gbs:.1f} GB/s")
    in_features = [w.shape[1] for w in flat]
    print(f"{'M':>4} " + " ".join(f"{name:>28}" for name in forms))
    for m in args.tokens:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}
        inputs = [xs[k] for k in in_features]
        cells = []
        for name, (fn, weights, nbytes) in forms.items():
            ms = median_ms(
                lambda fn=fn, weights=weights, inputs=inputs: [fn(x, w) for x, w in zip(inputs, weights)],
                args.repeats,
            )
            gbs = params * nbytes / ms / 1e6
            share = f" {100 * gbs / read_gbs:3.0f}%" if name.startswith("linear_int8") else ""
            cells.append(f"{ms:7.2f} ms {gbs:5.1f} GB/s{share}")
        print(f"{m:>4} " + " ".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
