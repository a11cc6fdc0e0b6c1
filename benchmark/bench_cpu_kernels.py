"""sgl-kernel's CPU kernels at the built-in model's shapes, against the alternatives they replace.

    python benchmark/bench_cpu_kernels.py                 # linears and decode attention
    python benchmark/bench_cpu_kernels.py --only linear --tokens 1 2 4 8 16 32

Linears: one decode step's worth of weights (30 layers of qkv / o / gate_up / down, then the
49,152 x 576 LM head), each weight its own tensor so they stream from memory as in a real step,
through sgl-kernel's linear_f32 and linear_f16, oneDNN over prepacked weights, and F.linear.
Decode attention: 30 layers of a paged KV pool, sgl-kernel's kernel with and without requests
sharing a prefix (the radix cache's case), against the torch-native backend's gather + SDPA.
Extend attention (--only extend): 30 layers of a paged pool, per-layer ms and GFLOP/s (causal
flops) of sgl-kernel's extend kernel, of SDPA over K/V already contiguous (batched when the
requests have one shape; a mask where they have a prefix), and of the torch-native backend's
forward_extend (per-request gather + SDPA).
Crossovers (--only crossovers): what `--cpu-kernel-tuning` picks on this CPU for the built-in model
(its GGUF default for the weight-only bound, fp32 for the small-M bound, --cpu-fp16-weights for
the fp16 one), measured now into a temporary cache, with each bound's timings (ms per pass over
the weights, small kernel vs oneDNN's GEMM; model_executor/cpu_tuning.py), and the int8-activation
choice on the GGUF (wq_a8_max_tokens: linear_wq_a8 vs linear_wq per pass; 0: int8 activations lose
at one row here; whether `auto` serves it: cpu_tuning.A8_BY_DEFAULT), and the weight-only
layers' batch GEMM numerics (wq_batch_bf16: oneDNN fp32 vs bf16 per pass at 16 and 64 rows; where
bf16 won, the wq_max_tokens row's oneDNN timings are the bf16 GEMM's), and whether batches take
int8 activations on panels (wq_batch_a8: the winning oneDNN GEMM vs the panels at 16, 64 and 512
rows, the 512-row pass over an eighth of the layers; where they won, the wq_max_tokens row's
"oneDNN" timings are the panels').
LoRA delta (--only lora): microseconds per projection call at rank 16 with 8 slots, 30 layers of
adapter slots (as the pool holds them), sgl-kernel's lora_delta_ against lora/kernels.py's dense
and segmented torch paths, for decode batches (rows spread over the adapters, a few base rows)
and prefill-like ones (long runs of one adapter's rows).
Each number is the median of several timed steps after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from sgl_kernel import cpu as cpu_kernels

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
LINEAR_SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def median_ms(step: Callable[[], None], repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        step()
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


def bench_linears(token_counts: list[int], repeats: int) -> None:
    weights = [[torch.randn(n, k) for n, k in LINEAR_SHAPES] for _ in range(LAYERS)]
    weights.append([torch.randn(VOCAB, HIDDEN)])
    flat = [w for layer in weights for w in layer]
    forms = {
        "sgl-kernel linear_f32": (cpu_kernels.linear_f32, flat),
        "sgl-kernel linear_f16 (fp16 weights)": (cpu_kernels.linear_f16, [w.half() for w in flat]),
        "oneDNN, prepacked": (
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in flat],
        ),
        "F.linear (MKL)": (F.linear, flat),
    }
    gb = sum(w.numel() for w in flat) * 4 / 1e9
    print(f"\n== linears: one decode step's weights ({gb:.2f} GB in fp32), ms per step")
    print(f"{'tokens':>6} " + " ".join(f"{name:>38}" for name in forms))
    in_features = [w.shape[1] for w in flat]
    for m in token_counts:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}
        inputs = [xs[k] for k in in_features]
        row = [median_ms(partial(_linear_step, fn, inputs, ws), repeats) for fn, ws in forms.values()]
        print(f"{m:>6} " + " ".join(f"{t:>38.2f}" for t in row))


def _linear_step(fn: Callable, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
    for x, w in zip(inputs, weights):
        fn(x, w)


def _paged_pool(
    bs: int, ctx: int, shared: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    size = bs * ctx + 64
    k = [torch.randn(size, NUM_KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    v = [torch.randn(size, NUM_KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    req_to_token = torch.zeros(bs, ctx, dtype=torch.int32)
    slots = torch.randperm(size - 1)[: bs * ctx].int() + 1  # scattered, as after some churn
    for b in range(bs):
        req_to_token[b] = slots[b * ctx : (b + 1) * ctx]
        req_to_token[b, :shared] = req_to_token[0, :shared]  # a radix-cache hit: the same slots
    return k, v, req_to_token


def bench_attention(cases: list[tuple[int, int, int]], repeats: int) -> None:
    print("\n== decode attention, 30 layers, ms per step")
    print(f"{'batch':>5} {'context':>8} {'shared':>7} {'sgl-kernel':>11} {'torch-native (gather+SDPA)':>27}")
    for bs, ctx, shared in cases:
        k, v, r2t = _paged_pool(bs, ctx, shared)
        q = torch.randn(bs, NUM_HEADS, HEAD_DIM)
        kernel = median_ms(partial(_kernel_step, q, k, v, r2t), repeats)
        reference = median_ms(partial(_reference_step, q, k, v, r2t), repeats)
        print(f"{bs:>5} {ctx:>8} {shared:>7} {kernel:>11.2f} {reference:>27.2f}")


def _kernel_step(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], r2t: torch.Tensor) -> None:
    bs, ctx = r2t.shape
    rows, lens = torch.arange(bs), torch.full((bs,), ctx)
    for layer in range(LAYERS):
        cpu_kernels.decode_attention(q, k[layer], v[layer], r2t, rows, lens, HEAD_DIM**-0.5)


def _reference_step(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], r2t: torch.Tensor) -> None:
    """What the torch-native backend does per layer: gather every request's K/V, then SDPA."""
    bs, ctx = r2t.shape
    flat = r2t.long().view(-1)
    for layer in range(LAYERS):
        kk = k[layer].index_select(0, flat).view(bs, ctx, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        vv = v[layer].index_select(0, flat).view(bs, ctx, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, enable_gqa=True)


def _extend_case(
    prefix: int, ext: int, bs: int
) -> tuple[
    list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]
]:
    """A 30-layer pool where each of `bs` requests has `prefix` cached tokens (the same slots for
    all: a radix hit) and `ext` new ones, slots scattered; plus each layer's q."""
    seq = prefix + ext
    size = prefix + bs * ext + 64
    k = [torch.randn(size, NUM_KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    v = [torch.randn(size, NUM_KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    slots = torch.randperm(size - 1)[: prefix + bs * ext].int() + 1
    req_to_token = torch.zeros(bs, seq, dtype=torch.int32)
    for b in range(bs):
        req_to_token[b, :prefix] = slots[:prefix]
        req_to_token[b, prefix:] = slots[prefix + b * ext : prefix + (b + 1) * ext]
    seq_lens, extend_lens = torch.full((bs,), seq), torch.full((bs,), ext)
    qs = [torch.randn(bs * ext, NUM_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    return k, v, req_to_token, seq_lens, extend_lens, qs


def bench_extend(cases: list[tuple[int, int, int]], repeats: int) -> None:
    threads, isa = torch.get_num_threads(), cpu_kernels.extend_attention_isa()
    print(
        f"\n== extend attention (H={NUM_HEADS}, Hkv={NUM_KV_HEADS}, D={HEAD_DIM}, {threads} threads, kernel {isa})"
    )
    print("   per layer: ms (GFLOP/s over causal flops), mean of 30 layers' pools")
    names = ("sgl-kernel", "SDPA, contiguous K/V", "torch-native forward_extend")
    print(f"{'batch':>5} {'prefix':>6} {'new':>5} " + " ".join(f"{n:>30}" for n in names))
    for prefix, ext, bs in cases:
        flops = 4 * NUM_HEADS * HEAD_DIM * bs * (ext * prefix + ext * (ext + 1) / 2)
        cells = [
            f"{ms:>8.2f} ms ({flops / ms / 1e6:>4.0f} GFLOP/s)"
            for ms in _extend_times(prefix, ext, bs, repeats)
        ]
        print(f"{bs:>5} {prefix:>6} {ext:>5} " + " ".join(f"{c:>30}" for c in cells))


def _extend_times(prefix: int, ext: int, bs: int, repeats: int) -> list[float]:
    """Per-layer ms of the kernel, of SDPA over contiguous K/V and of the torch-native backend."""
    from types import SimpleNamespace

    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.layers.attention.torch_native import TorchNativeAttnBackend, TorchNativeMetadata

    k, v, r2t, seq_lens, extend_lens, qs = _extend_case(prefix, ext, bs)
    rows, scale = torch.arange(bs), HEAD_DIM**-0.5

    def kernel() -> None:
        for i in range(LAYERS):
            cpu_kernels.extend_attention(qs[i], k[i], v[i], r2t, rows, seq_lens, extend_lens, scale)

    # The ideal torch case: K/V already contiguous per request (no gather), one batched SDPA call.
    flat = r2t.long().view(-1)
    shape = (bs, prefix + ext, NUM_KV_HEADS, HEAD_DIM)
    kk = [x.index_select(0, flat).view(shape).transpose(1, 2) for x in k]
    vv = [x.index_select(0, flat).view(shape).transpose(1, 2) for x in v]
    qq = [x.view(bs, ext, NUM_HEADS, HEAD_DIM).transpose(1, 2) for x in qs]
    mask = (
        torch.arange(prefix + ext)[None, :] <= torch.arange(prefix, prefix + ext)[:, None] if prefix else None
    )

    def sdpa() -> None:
        for i in range(LAYERS):
            F.scaled_dot_product_attention(
                qq[i], kk[i], vv[i], attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )

    # The backend's own forward_extend over these pools; K/V are already stored, so no store.
    layer = RadixAttention(NUM_HEADS, HEAD_DIM, scale, NUM_KV_HEADS, 0)
    backend = TorchNativeAttnBackend(torch.device("cpu"))
    fb = SimpleNamespace(
        extend_seq_lens_cpu=[ext] * bs,
        seq_lens_cpu=[prefix + ext] * bs,
        req_pool_indices=rows,
        req_to_token_pool=SimpleNamespace(req_to_token=r2t),
        out_cache_loc=None,
    )
    fb.attn_metadata = TorchNativeMetadata(segments=backend._extend_segments(fb))  # type: ignore[arg-type]
    pools = [
        SimpleNamespace(set_kv_buffer=lambda *a: None, get_kv_buffer=lambda _, kv=kv: kv) for kv in zip(k, v)
    ]

    def native() -> None:
        for i in range(LAYERS):
            fb.token_to_kv_pool = pools[i]
            backend.forward_extend(qs[i], None, None, layer, fb)  # type: ignore[arg-type]

    return [median_ms(step, repeats) / LAYERS for step in (kernel, sdpa, native)]


def bench_gemm_rates(tokens: list[int], repeats: int) -> None:
    """One warm oneDNN GEMM per MLP shape, fp32 and bf16 (what --cpu-bf16-gemm uses), in GFLOP/s."""
    print("== oneDNN GEMM rate, one warm weight (GFLOP/s); bf16 needs a CPU that can pack it")
    print(f"{'tokens':>6} {'out x in':>11} {'fp32':>8} {'bf16':>8}")
    for m in tokens:
        for n, k in (LINEAR_SHAPES[2], LINEAR_SHAPES[3]):
            x, w = torch.randn(m, k), torch.randn(n, k)
            rates = []
            for dtype in (torch.float32, torch.bfloat16):
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
                except RuntimeError:
                    rates.append(float("nan"))
                    continue
                xd = x.to(dtype)
                ms = median_ms(
                    lambda xd=xd, p=packed: torch.ops.mkldnn._linear_pointwise(xd, p, None, "none", [], ""),
                    repeats,
                )
                rates.append(2 * m * n * k / ms / 1e6)
            print(f"{m:>6} {f'{n}x{k}':>11} {rates[0]:>8.0f} {rates[1]:>8.0f}")


def bench_crossovers() -> None:
    import json
    import os
    import tempfile
    from pathlib import Path

    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.cpu_crossovers import active
    from radixserve.model_executor.tp_worker import TpModelWorker
    from radixserve.server_args import ServerArgs

    os.environ["RADIXSERVE_CPU_TUNING_DIR"] = tempfile.mkdtemp(prefix="crossovers_")
    chosen: dict[str, int] = {}
    for form, bound, extra in [
        ("GGUF Q4_1 (the default)", "wq_max_tokens", {}),
        ("GGUF Q4_1, int8 activations", "wq_a8_max_tokens", {"cpu_kernel_tuning": "auto"}),
        ("fp32", "f32_small_max_tokens", {"quantization": "unquant"}),
        ("fp32 + fp16 copies", "f16_max_tokens", {"quantization": "unquant", "cpu_fp16_weights": True}),
    ]:
        # The int8-activation row reads the cache the first row just measured (same CPU and model).
        extra = {"cpu_kernel_tuning": "measure", **extra}
        args = ServerArgs(device="cpu", max_total_tokens=4096, **extra).resolve()
        TpModelWorker(args, ModelConfig.from_path(args.model_path, dtype="float32"))
        cache = Path(active().source.split(" at ")[1].split(";")[0])
        data = json.loads(cache.read_text())
        chosen[bound] = data["bounds"][bound]
        timings = data["timings_ms_small_vs_gemm"].get(bound, {})
        names = ("linear_wq_a8", "linear_wq") if bound == "wq_a8_max_tokens" else ("small kernel", "oneDNN")
        served = f" (served by auto: {getattr(active(), bound)})" if bound == "wq_a8_max_tokens" else ""
        print(f"{form}: {bound} = {chosen[bound]}{served}")
        for n, (small, other) in timings.items():
            print(f"  {n:>3} tokens: {names[0]} {small:8.2f} ms, {names[1]} {other:8.2f} ms per pass")
        if bound == "wq_max_tokens":
            _print_batch_numerics(data, active().wq_batch_bf16, active().wq_batch_a8)
    print("crossovers:", chosen)


def _print_batch_numerics(data: dict, served: bool, a8_served: bool) -> None:
    """The weight-only layers' batch GEMM choices in a crossover cache (cpu_batch_numerics.py)."""
    measured = "bf16" if data.get("wq_batch_bf16") else "fp32"
    print(
        f"GGUF Q4_1 batch GEMMs: wq_batch_bf16 = {measured} (served by auto: {'bf16' if served else 'fp32'})"
    )
    for n, (fp32, bf16) in data["timings_ms_small_vs_gemm"].get("wq_batch_bf16", {}).items():
        print(f"  {n:>3} tokens: oneDNN fp32 {fp32:8.2f} ms, oneDNN bf16 {bf16:8.2f} ms per pass")
    print(
        f"GGUF Q4_1 batches on int8 activations: wq_batch_a8 = {data.get('wq_batch_a8')} (served: {a8_served})"
    )
    for n, (gemm, a8) in data["timings_ms_small_vs_gemm"].get("wq_batch_a8", {}).items():
        print(
            f"  {n:>3} tokens: the oneDNN GEMM {gemm:8.2f} ms, int8-activation panels {a8:8.2f} ms per pass"
        )


LORA_SHAPES = ((HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN))
# (rows, adapters among them): decode at C=16 and C=64 over 8 adapters and over one, then prefills.
LORA_CASES = ((16, 8), (64, 8), (64, 1), (256, 8), (512, 1), (2048, 4))


def _lora_slots(rows: int, adapters: int) -> torch.Tensor:
    """[rows] slots: a decode batch (rows <= 64) interleaves adapters with every 8th row a base
    row; a prefill gives each adapter one contiguous run."""
    if rows <= 64:
        slots = torch.arange(rows) % adapters
        slots[7::8] = -1
        return slots
    return torch.arange(rows) * adapters // rows


LORA_FORMS = ("compiled", "dense", "segmented")


def bench_lora(repeats: int, rank: int = 16, num_slots: int = 8) -> None:
    print(
        f"\n== LoRA delta, rank {rank}, {num_slots} slots: us per projection call (mean of {LAYERS} layers)"
    )
    print(f"{'rows':>5} {'adapters':>8} {'in->out':>10} " + " ".join(f"{f:>10}" for f in LORA_FORMS))
    for rows, adapters in LORA_CASES:
        for d_in, d_out in LORA_SHAPES:
            us = _lora_case(rows, adapters, d_in, d_out, rank, num_slots, repeats)
            print(f"{rows:>5} {adapters:>8} {f'{d_in}->{d_out}':>10} " + " ".join(f"{t:>10.1f}" for t in us))


def _lora_case(
    rows: int, adapters: int, d_in: int, d_out: int, rank: int, num_slots: int, repeats: int
) -> list[float]:
    """Microseconds per call of each LORA_FORMS form, each layer its own slots' tensors."""
    from radixserve.lora import kernels

    token_slots = _lora_slots(rows, adapters)  # [rows]
    segments = kernels.LoRASegments.build(token_slots)
    a = [torch.randn(num_slots, rank, d_in) * 0.05 for _ in range(LAYERS)]
    b = [torch.randn(num_slots, rank, d_out) * 0.05 for _ in range(LAYERS)]
    x, out = torch.randn(rows, d_in), torch.zeros(rows, d_out)
    calls = {
        "compiled": lambda i: cpu_kernels.lora_delta_(x, a[i], b[i], token_slots, out),
        "dense": lambda i: kernels.lora_delta_dense(x, a[i], b[i], segments, out),
        "segmented": lambda i: kernels.lora_delta_segmented(x, a[i], b[i], segments, out),
    }
    steps = [partial(_per_layer, calls[f]) for f in LORA_FORMS]
    return [1e6 * t / LAYERS for t in _interleaved_medians(steps, repeats)]


def _interleaved_medians(steps: list[Callable[[], None]], repeats: int) -> list[float]:
    """Median seconds of each step, the steps taking turns (on a shared machine, a slow spell
    then hits every form alike, not the one that happened to run in it)."""
    for step in steps:
        step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, ts in zip(steps, times):
            tic = time.perf_counter()
            step()
            ts.append(time.perf_counter() - tic)
    return [statistics.median(ts) for ts in times]


def _per_layer(call: Callable[[int], None]) -> None:
    for i in range(LAYERS):
        call(i)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only", choices=("linear", "attention", "gemm", "extend", "crossovers", "lora"), default=None
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = p.parse_args(argv)
    if not cpu_kernels.available():
        raise SystemExit("sgl-kernel's CPU extension is not built (make setup builds it)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.only in (None, "linear"):
        bench_linears(args.tokens, args.repeats)
    if args.only in (None, "attention"):
        bench_attention([(1, 1100, 0), (8, 1100, 0), (8, 1100, 1024), (64, 160, 0)], args.repeats)
    if args.only in (None, "gemm"):
        bench_gemm_rates([64, 512], args.repeats)
    if args.only == "crossovers":
        bench_crossovers()
    if args.only == "extend":  # opt-in: the default run prints what it always has
        # (prefix, new tokens, requests): one prompt, short turns over a shared cached prefix, a
        # batch of mid-size prompts.
        bench_extend([(0, 1088, 1), (1024, 64, 8), (0, 256, 4)], args.repeats)
    if args.only == "lora":  # opt-in, like extend
        bench_lora(args.repeats)


if __name__ == "__main__":
    main()
