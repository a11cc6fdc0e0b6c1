"""The GEMM tiles (sgl-kernel's wq_a8_gemm.h; --isa avx512: VNNI, avx2: AVX2's vpmaddubsw sums) in
G multiply-adds/s of one thread's CPU time, on
the shapes they serve: the built-in model's decoder linears (hidden 576, intermediate 1536, 9 / 3
heads x 64: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and Qwen3-30B-A3B's experts
(gate_up 1536x2048, down 2048x768), each called on `--copies` copies in turn (1: the weights stay
in cache; 16 experts' copies stream from memory as a MoE's do). Includes x's quantization (part
of every served call). Read against Zen 4's ceiling for these tiles, not vpdpbusd's 226 G
multiply-adds/s a core (benchmark/dot_peak.cpp): the epilogue's vmulps and vfmadd share
vpdpbusd's two pipes (benchmark/dot_pipes.cpp), so ~164 for Q4_0/Q4_1 and ~181 for Q8_0
(docs/cpu_backend.md, "Where the tile's cycles go"). Thread CPU time; --stat min (the least of
--repeats) is the least disturbed on a shared machine.

    python benchmark/bench_wq_a8_tiles.py                       # both suites, default M
    python benchmark/bench_wq_a8_tiles.py --suite builtin --tokens 16 64 --repeats 7
    python benchmark/bench_wq_a8_tiles.py --isa avx2            # the AVX2 path on any x86 CPU
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from sgl_kernel import cpu as cpu_kernels

BUILTIN = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
EXPERT = {"gate_up": (1536, 2048), "down": (2048, 768)}


def _packed(n: int, k: int, kind: str, seed: int) -> cpu_kernels.WqA8Packed:
    """A random GGUF-like form (fp16 scales; Q4_0 a zero point, Q4_1 offsets) packed in panels."""
    gen = torch.Generator().manual_seed(seed)
    bits = 8 if kind == "Q8_0" else 4
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half().float()
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    offsets = None
    if kind == "Q4_0":
        offsets = scales * -8.0
    elif kind == "Q4_1":
        offsets = (torch.randn(n, k // 32, generator=gen) * 0.01).half().float()
    return cpu_kernels.pack_wq_a8(q, scales, offsets, bits, 32, dtype=torch.float16)


def _time(fn: Callable[[], None], repeats: int, stat: str = "median") -> float:
    """Median (or least: the least disturbed on a shared machine) thread CPU seconds of fn()."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    times.sort()
    return times[0] if stat == "min" else times[len(times) // 2]


def run_suite(
    shapes: dict[str, tuple[int, int]],
    kind: str,
    tokens: list[int],
    copies: int,
    repeats: int,
    stat: str,
    isa: str = "auto",
) -> None:
    forms = {
        name: [_packed(n, k, kind, 7 * i + j) for j in range(copies)]
        for i, (name, (n, k)) in enumerate(shapes.items())
    }
    for m in tokens:
        cells, macs_all, t_all = [], 0, 0.0
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k)

            def call(packs: list[cpu_kernels.WqA8Packed] = forms[name], x: torch.Tensor = x) -> None:
                for p in packs:
                    cpu_kernels.linear_wq_a8(x, None, None, None, p.bits, p.group_size, isa=isa, packed=p)

            t = _time(call, repeats, stat)
            macs = m * n * k * copies
            macs_all, t_all = macs_all + macs, t_all + t
            cells.append(f"{name} {macs / t / 1e9:6.1f}")
        print(
            f"{kind} M={m:5d}: all {macs_all / t_all / 1e9:6.1f} G MAC/s ({t_all * 1e3:8.2f} ms) | "
            + " | ".join(cells),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", nargs="+", default=["builtin", "expert"], choices=["builtin", "expert"])
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--types", nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stat", choices=["median", "min"], default="median")
    ap.add_argument("--isa", choices=["auto", "avx2", "avx512"], default="auto", help="the tiles' path")
    ap.add_argument(
        "--copies", type=int, default=None, help="weight copies called in turn (default 4 builtin, 16 expert)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "builtin" in args.suite:
        for kind in args.types or ["Q4_1", "Q8_0"]:
            run_suite(
                BUILTIN,
                kind,
                args.tokens or [16, 64, 512, 2048],
                args.copies or 4,
                args.repeats,
                args.stat,
                args.isa,
            )
    if "expert" in args.suite:
        for kind in args.types or ["Q4_0", "Q8_0"]:
            run_suite(
                EXPERT, kind, args.tokens or [4, 8, 16], args.copies or 16, args.repeats, args.stat, args.isa
            )


if __name__ == "__main__":
    main()
