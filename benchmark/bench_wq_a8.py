"""linear_wq's three CPU paths on a GGUF MoE's decode shapes, in thread CPU time per call:

- fp32: linear_wq (fp32 activations, the weight dequantized in registers);
- a8 rows: linear_wq_a8 on the canonical rows (int8 activations per 32 inputs);
- a8 panels: linear_wq_a8 on the weight repacked in 8-row panels (pack_wq_a8, what a form marked
  by --cpu-wq-int8-activations carries: the file's bytes, fp16 scales, Q4_0's offsets formed from
  the scales);
- a8 panels fp32 (--fp32-panels): the same panels with fp32 scales and every offset stored (the
  layout before the panels held the file's bytes), to compare the two back to back.

    python benchmark/bench_wq_a8.py                              # M = 1 2 4 8 16, one thread
    python benchmark/bench_wq_a8.py --types Q4_0 --tokens 1 3 6 12 16 --repeats 9
    python benchmark/bench_wq_a8.py --tokens 1 16 128 --paths "a8 panels avx2" "a8 panels fp32 avx2" --fp32-panels
    python benchmark/bench_wq_a8.py --isas avx2 avx512                # AVX2 against AVX-512 VNNI
    python benchmark/bench_wq_a8.py --model builtin --threads 2 --types Q4_1 Q4_0 Q8_0

Each int8-activation path runs once per code path of --isas (default: every one built here:
"avx2", and "avx512", vpdpbusd, where the CPU has AVX-512 VNNI). --model builtin instead times one
decode step of the built-in model's decoder (30 layers' qkv / o / gate_up / down) and its LM head
on the panels, per isa, as ms per step and the share of the step's bytes at the machine's read
bandwidth (profile_moe_decode.py's bandwidth_gbs): the issue's bytes-per-token bound.

Shapes: Qwen3-30B-A3B's (hidden 2048, expert width 768): the LM head (--vocab rows; 32768 by
default, which already streams from memory: the 151936-row head is the same per weight), one
expert's gate_up (1536 x 2048) and down (2048 x 768) projections, 16 experts' copies of each
called in turn so they stream too. Thread CPU time (time.thread_time) on one thread by default: a
shared machine inflates wall time, much less a thread's own CPU time; still indicative only. Per
cell: median ms per call, and G weights/s (weights per call over that time). What the crossover
says sets layers/group_quant.py's A8_MAX_ROWS (rows up to which marked forms take int8 activations).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_wq_a8_model import bench_builtin

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from sgl_kernel import cpu as cpu_kernels

TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
EXPERTS = 16


def random_form(n: int, k: int, type_name: str) -> GroupQuantWeight:
    """Random integers with fp16 scales (and Q4_1's offsets) as gguf_quant.py makes the forms:
    Q4_0's offsets are -8 * scale."""
    scales = (torch.rand(n, k // 32) * 0.01).half().float()
    if type_name == "Q8_0":
        return GroupQuantWeight(torch.randint(-127, 128, (n, k)).to(torch.int8), scales, None, 32, 8)
    qweight = pack_int4(torch.randint(0, 16, (n, k)))
    off = scales * -8.0 if type_name == "Q4_0" else (torch.rand(n, k // 32) - 0.5).half().float()
    return GroupQuantWeight(qweight, scales, off, 32, 4)


def simd_isas() -> list[str]:
    """linear_wq_a8's SIMD paths built here: "avx2", and "avx512" (VNNI) where compiled."""
    return [isa for isa in cpu_kernels.linear_wq_a8_isas() if isa != "scalar"]


def paths(
    w: GroupQuantWeight, fp32_panels: bool, isas: list[str]
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Path name -> fn(x). Every int8-activation path once per isa in `isas` ("a8 rows avx2",
    "a8 panels avx512", ...)."""
    args = (w.qweight, w.scales, w.offsets, w.bits, w.group_size)
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "fp32": lambda x: cpu_kernels.linear_wq(x, *args)
    }
    packed = full = None
    if cpu_kernels.linear_wq_a8_packed_available():
        packed = cpu_kernels.pack_wq_a8(*args)
        if fp32_panels:
            full = cpu_kernels.pack_wq_a8(*args, zero_point=0, dtype=torch.float32)
    for isa in isas:
        out[f"a8 rows {isa}"] = lambda x, isa=isa: cpu_kernels.linear_wq_a8(x, *args, isa=isa)
        if packed is not None:
            out[f"a8 panels {isa}"] = lambda x, isa=isa: cpu_kernels.linear_wq_a8(
                x, *args, isa=isa, packed=packed
            )
        if full is not None:
            out[f"a8 panels fp32 {isa}"] = lambda x, isa=isa: cpu_kernels.linear_wq_a8(
                x, *args, isa=isa, packed=full
            )
    return out


def selected(path: str, wanted: list[str]) -> bool:
    """Whether --paths names `path`; a name without its isa ("a8 panels") names it on every isa."""
    return path in wanted or path.rsplit(" ", 1)[0] in wanted


def cpu_ms(calls: list[Callable[[], object]], repeats: int) -> float:
    """Median thread CPU ms of one pass over `calls`, per call."""
    for call in calls:
        call()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for call in calls:
            call()
        times.append((time.thread_time() - start) * 1e3 / len(calls))
    return statistics.median(times)


def bench(
    name: str,
    shape: tuple[int, int],
    copies: int,
    types: list[str],
    tokens: list[int],
    args: argparse.Namespace,
) -> None:
    n, k = shape
    print(f"\n{name} [{n} x {k}], {copies} cop{'y' if copies == 1 else 'ies'} called in turn")
    for type_name in types:
        forms = [random_form(n, k, type_name) for _ in range(copies)]
        table = [paths(w, args.fp32_panels, args.isas) for w in forms]
        if args.paths:
            table = [{p: fn for p, fn in t.items() if selected(p, args.paths)} for t in table]
        print(f"  {type_name:5} {'M':>3} " + " ".join(f"{p:>22}" for p in table[0]))
        for m in tokens:
            x = torch.randn(m, k)
            cells = []
            for path in table[0]:
                ms = cpu_ms([lambda fn=t[path], x=x: fn(x) for t in table], args.repeats)
                cells.append(f"{ms:8.3f} ms {n * k * m / ms / 1e6:6.2f} G/s")
            print(f"  {'':5} {m:>3} " + " ".join(f"{c:>22}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--types", nargs="+", choices=sorted(TYPES), default=["Q4_0", "Q8_0"])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fp32-panels", action="store_true", help="also the fp32-scale panels")
    parser.add_argument(
        "--paths", nargs="+", help='only these paths (default: every one; "a8 panels": on every isa)'
    )
    parser.add_argument(
        "--isas", nargs="+", help='int8-activation paths ("avx2", "avx512"; default: all built)'
    )
    parser.add_argument(
        "--model",
        choices=["builtin"],
        help="instead: one decode step of the built-in model's panels per isa, against the bandwidth",
    )
    args = parser.parse_args()
    if not cpu_kernels.linear_wq_a8_isas():
        raise SystemExit("sgl_kernel._cpu is not built with linear_wq_a8")
    args.isas = args.isas or simd_isas()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model:
        bench_builtin(random_form, args.types, args.tokens, args.isas, args.repeats)
        return
    print(f"{torch.get_num_threads()} thread(s); G/s = weights x rows per second")
    bench("LM head", (args.vocab, 2048), 1, args.types, args.tokens, args)
    bench("expert gate_up", (1536, 2048), EXPERTS, args.types, args.tokens, args)
    bench("expert down", (2048, 768), EXPERTS, args.types, args.tokens, args)


if __name__ == "__main__":
    main()
