"""GPU measurements (issue #7): attention kernel times per backend, and the decode-step HBM ceiling.

    python benchmark/bench_gpu.py make-models --out .gpu_models      # config-only model folders
    python benchmark/bench_gpu.py attention --out attention.md       # triton / flashinfer / torch_native
    python benchmark/bench_gpu.py ceiling --config .gpu_models/llama3-8b --result-file decode.jsonl

`make-models` writes two folders that load with `--load-format dummy` (no weights travel):
`llama3-8b` (Llama-3-8B's shapes; bench_one_batch needs no tokenizer) and `smollm2-135m` (the
built-in model's config and tokenizer, for the Engine-based overlap on/off run).

`attention` times one layer's attention call (KV store + attention) and the per-step metadata
(`init_forward_metadata`, amortized over the model's layers in a real step) for each backend, at
Llama-3-8B's head shape (32 query heads, 8 KV heads, head_dim 128), on four batches: decode bs=1
over 4096 tokens, decode bs=64 over 1024, one 2048-token prompt, 8 x 64 new tokens over 1024
cached. Decode is bandwidth-bound, so it also reports the K/V bytes read per second.

`ceiling` turns bench_one_batch's decode latencies into a fraction of the HBM-bandwidth bound: a
decode step must read every weight once plus each request's K/V.

scripts/gpu/run_checks.sh runs all of it on the device machine; `--device cpu --small` runs the
same code with tiny shapes on a CPU (the unit test does, so the script cannot rot without a GPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


# ---------------------------------------------------------------------------------------- models
def make_models(out: Path) -> None:
    from radixserve.model_loader.default_model import ensure_default_model

    llama = out / "llama3-8b"
    llama.mkdir(parents=True, exist_ok=True)
    (llama / "config.json").write_text(json.dumps(LLAMA3_8B, indent=2))
    small = out / "smollm2-135m"
    small.mkdir(parents=True, exist_ok=True)
    builtin = Path(ensure_default_model())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (builtin / name).exists():
            shutil.copy(builtin / name, small / name)
    # Llama-3-8B's shapes with the small model's tokenizer (vocabulary 49152): servable through the
    # HTTP and Engine paths, which need a tokenizer (run_checks.sh lease overlap8b, serving_profile).
    small_config = json.loads((small / "config.json").read_text())
    tok = out / "llama3-8b-tok"
    tok.mkdir(parents=True, exist_ok=True)
    shaped = {**LLAMA3_8B, **{k: small_config[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}}
    (tok / "config.json").write_text(json.dumps(shaped, indent=2))
    for f in small.iterdir():
        if f.name != "config.json":
            shutil.copy(f, tok / f.name)
    print(f"wrote {llama}, {small} and {tok} (config + tokenizer only: load them with load_format=dummy)")


# ---------------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class AttnShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int  # of the model: the per-step metadata is shared by this many layer calls


@dataclass(frozen=True)
class AttnCase:
    name: str
    decode: bool
    prefix_lens: tuple[int, ...]  # cached tokens per request (decode: the context before this token)
    new_lens: tuple[int, ...]  # tokens computed this step (decode: 1 each)


LLAMA3_8B_ATTN = AttnShape(32, 8, 128, 32)
CASES = (
    AttnCase("decode bs=1 ctx=4096", True, (4095,), (1,)),
    AttnCase("decode bs=64 ctx=1024", True, (1023,) * 64, (1,) * 64),
    AttnCase("extend 1x2048", False, (0,), (2048,)),
    AttnCase("extend 8x64 over 1024 cached", False, (1024,) * 8, (64,) * 8),
)
SMALL_SHAPE = AttnShape(4, 2, 16, 2)
SMALL_CASES = (
    AttnCase("decode bs=2 ctx=33", True, (32, 20), (1, 1)),
    AttnCase("extend 2x17 over 8 cached", False, (8, 0), (17, 17)),
)


def _timed_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median milliseconds of `fn` after a warm-up call (CUDA: synchronised around each call)."""
    fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - tic) * 1e3)
    return statistics.median(samples)


def _attention_inputs(case: AttnCase, shape: AttnShape, dtype: torch.dtype, device: torch.device) -> Any:  # noqa: ANN401
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch

    seq_lens = [p + n for p, n in zip(case.prefix_lens, case.new_lens)]
    total = sum(seq_lens)
    gen = torch.Generator().manual_seed(0)
    slots = (torch.randperm(total, generator=gen) + 1).to(torch.int32)  # scattered; slot 0 = padding
    rtp = ReqToTokenPool(len(seq_lens), max(seq_lens), device)
    out_loc, start = [], 0
    for i, n in enumerate(seq_lens):
        row = slots[start : start + n]
        rtp.req_to_token[i, :n] = row.to(device)
        out_loc.append(row[case.prefix_lens[i] :])
        start += n
    kv = MHATokenToKVPool(total + 1, 1, dtype, 1, shape.num_kv_heads, shape.head_dim, device)
    kv.k_buffer[0].normal_()
    kv.v_buffer[0].normal_()
    out_cache_loc = torch.cat(out_loc).long()
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE if case.decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(out_cache_loc.numel(), dtype=torch.int64),
        req_pool_indices=torch.arange(len(seq_lens)),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=out_cache_loc,
        sampling_info=None,
        extend_seq_lens=None if case.decode else list(case.new_lens),
        extend_prefix_lens=None if case.decode else list(case.prefix_lens),
        extend_num_tokens=out_cache_loc.numel(),
    )
    return batch, rtp, kv


def bench_attention_case(
    backend_name: str, case: AttnCase, shape: AttnShape, dtype: torch.dtype, device: torch.device, iters: int
) -> dict[str, Any]:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch import ForwardBatch
    from radixserve.model_executor.model_runner import create_attention_backend

    backend = create_attention_backend(backend_name, device)
    batch, rtp, kv = _attention_inputs(case, shape, dtype, device)
    layer = RadixAttention(shape.num_heads, shape.head_dim, shape.head_dim**-0.5, shape.num_kv_heads, 0)
    n = batch.extend_num_tokens
    q = torch.randn(n, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    k = torch.randn(n, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    v = torch.randn(n, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    fb = ForwardBatch.init_new(batch, rtp, kv, backend, device)
    metadata_ms = _timed_ms(lambda: ForwardBatch.init_new(batch, rtp, kv, backend, device), device, iters)
    layer_ms = _timed_ms(lambda: layer(q, k, v, fb), device, iters)
    seq_tokens = int(batch.seq_lens.sum())
    kv_bytes = seq_tokens * shape.num_kv_heads * shape.head_dim * 2 * kv.k_buffer[0].element_size()
    return {
        "backend": backend_name,
        "case": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        "layer_ms": layer_ms,
        "metadata_ms": metadata_ms,
        "step_ms": layer_ms * shape.num_layers + metadata_ms,  # attention's share of one model step
        "kv_gb_per_s": kv_bytes / (layer_ms * 1e-3) / 1e9 if case.decode else None,
    }


def run_attention(
    backends: list[str], dtype: torch.dtype, device: torch.device, small: bool, iters: int
) -> list[dict[str, Any]]:
    shape, cases = (SMALL_SHAPE, SMALL_CASES) if small else (LLAMA3_8B_ATTN, CASES)
    rows = []
    for case in cases:
        for name in backends:
            try:
                rows.append(bench_attention_case(name, case, shape, dtype, device, iters))
            except Exception as e:  # a backend that cannot run here (flashinfer missing, ...) is reported
                rows.append({"backend": name, "case": case.name, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def attention_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | backend | attention per layer (ms) | metadata per step (ms) | decode K/V read (GB/s) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['backend']} | failed: {r['error'][:80]} | | |")
            continue
        gbs = f"{r['kv_gb_per_s']:.0f}" if r["kv_gb_per_s"] is not None else ""
        lines.append(
            f"| {r['case']} | {r['backend']} | {r['layer_ms']:.3f} | {r['metadata_ms']:.3f} | {gbs} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- ceiling
def decode_bytes(config: dict[str, Any], batch_size: int, context_len: int, bytes_per_value: int) -> int:
    """Bytes one decode step must read: every weight matrix once (the embedding only per token)
    plus each request's K/V over all layers."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    head_dim = config.get("head_dim", h // heads)
    per_layer = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * inter + 2 * h
    lm_head = config["vocab_size"] * h
    weights = layers * per_layer + lm_head + h + batch_size * h
    kv = batch_size * context_len * layers * kv_heads * head_dim * 2
    return (weights + kv) * bytes_per_value


def ceiling_rows(config: dict[str, Any], results: list[dict[str, Any]], hbm_tb_per_s: float) -> list[str]:
    lines = [
        "| batch | context | decode step (ms) | HBM bound (ms) | fraction of bound | tok/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.get("engine") != "radixserve":
            continue
        context = r["input_len"] + r["output_len"] // 2  # mean context over the decode steps
        bound_s = decode_bytes(config, r["batch_size"], context, 2) / (hbm_tb_per_s * 1e12)
        step_s = r["median_decode_latency"]
        lines.append(
            f"| {r['batch_size']} | {context} | {step_s * 1e3:.2f} | {bound_s * 1e3:.2f} | "
            f"{bound_s / step_s:.0%} | {r['median_decode_throughput']:.0f} |"
        )
    return lines


# ---------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-models")
    p.add_argument("--out", type=Path, default=Path(".gpu_models"))
    p = sub.add_parser("attention")
    p.add_argument("--backends", nargs="+", default=["torch_native", "triton", "flashinfer"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write the Markdown table here too")
    p = sub.add_parser("ceiling")
    p.add_argument("--config", type=Path, required=True, help="model folder (its config.json)")
    p.add_argument("--result-file", type=Path, required=True, help="bench_one_batch's JSON lines")
    p.add_argument("--hbm-tb-per-s", type=float, default=3.35, help="H100 SXM: 3.35; H200: 4.8")
    p.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    if args.cmd == "make-models":
        make_models(args.out)
        return
    if args.cmd == "attention":
        rows = run_attention(
            args.backends, getattr(torch, args.dtype), torch.device(args.device), args.small, args.iters
        )
        text = attention_table(rows)
    else:
        config = json.loads((args.config / "config.json").read_text())
        results = [json.loads(line) for line in args.result_file.read_text().splitlines() if line.strip()]
        text = "\n".join(ceiling_rows(config, results, args.hbm_tb_per_s))
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
