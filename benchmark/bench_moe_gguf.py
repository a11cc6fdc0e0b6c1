"""A MoE GGUF of Qwen3-30B-A3B's per-layer shape with random weights, served side by side by
radixserve (`--model-path file.gguf`: its quantized experts, docs/quantization.md) and llama.cpp's
llama-server on the same file; output tok/s at each --concurrency, 128 in / 128 out.

    python benchmark/bench_moe_gguf.py                           # Q4_0 and Q8_0, 4 layers, C=1 and 16
    python benchmark/bench_moe_gguf.py --layers 12 --types Q4_0   # more layers (~10 GiB of Q4_0)
    python benchmark/bench_moe_gguf.py --write-only               # only the files
    python benchmark/bench_moe_gguf.py --types Q4_0 --radixserve-flags=--cpu-wq-int8-activations
    python benchmark/bench_moe_gguf.py --smoke                    # a tiny shape, 2 requests: the pipeline only

The shape per layer (Qwen3-30B-A3B): hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
width 768, top-8 renormalised, vocabulary 151936; --layers of them (the model has 48). Weights are
random GGUF blocks with scales sized so activations stay O(1) (tiny_gguf.random_gguf_blocks);
norms are 1, the router F32. The tokenizer is the tests' tiny BPE, padded to the vocabulary
(random-ids prompts are exact token counts whatever the tokenizer). Files go to --out-dir and are
reused. Results go to --results-file (JSONL), one row per engine, type and concurrency.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from peers import llama_cpp
from peers.process import ServerProcess, free_port
from peers.workloads import Workload, run_serving

# name -> (hidden, heads, kv_heads, head_dim, experts, top_k, expert width, vocab)
SHAPES = {
    "qwen3-30b-a3b": (2048, 32, 4, 128, 128, 8, 768, 151936),
    "smoke": (256, 4, 2, 64, 8, 2, 128, 512),
}
# The std of q (minus its zero point) per type: a scale of 0.02 / q_std gives weights of std ~0.02.
_Q_STD = {"Q8_0": 73.0, "Q4_0": 4.6}


def _blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, experts: int = 0) -> np.ndarray:
    from radixserve.testing.tiny_gguf import random_gguf_blocks

    std = 1.0 / np.sqrt(cols) / _Q_STD[kind]
    if not experts:
        return random_gguf_blocks(kind, rows, cols, rng, magnitude=std)
    return np.stack([random_gguf_blocks(kind, rows, cols, rng, magnitude=std) for _ in range(experts)])


def write_moe_gguf(path: Path, kind: str, layers: int, shape: tuple[int, ...], seed: int = 0) -> Path:
    """A qwen3moe GGUF of `layers` layers of `shape`, every matrix of GGUF type `kind`."""
    import gguf

    from radixserve.testing.tiny_gguf import _tokenizer_fields
    from radixserve.testing.tiny_models import CHATML_TEMPLATE

    hidden, heads, kv_heads, head_dim, experts, top_k, inter, vocab = shape
    rng = np.random.default_rng(seed)
    tokens, merges, types = _tokenizer_fields()
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [5] * (vocab - len(types))
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in (
        (writer.add_block_count, layers),
        (writer.add_context_length, 4096),
        (writer.add_embedding_length, hidden),
        (writer.add_feed_forward_length, 6144),
        (writer.add_head_count, heads),
        (writer.add_head_count_kv, kv_heads),
        (writer.add_key_length, head_dim),
        (writer.add_value_length, head_dim),
        (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_rope_freq_base, 1e6),
        (writer.add_vocab_size, vocab),
        (writer.add_expert_count, experts),
        (writer.add_expert_used_count, top_k),
        (writer.add_expert_feed_forward_length, inter),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "default"),
        (writer.add_token_list, tokens),
        (writer.add_token_merges, merges),
        (writer.add_token_types, types),
        (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2),
        (writer.add_pad_token_id, 0),
        (writer.add_chat_template, CHATML_TEMPLATE),
    ):
        add(value)
    qtype = gguf.GGMLQuantizationType[kind]
    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", _blocks(kind, vocab, hidden, rng), raw_dtype=qtype)
    for i in range(layers):
        q, kv = heads * head_dim, kv_heads * head_dim
        for name, rows, cols in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden)):
            writer.add_tensor(f"blk.{i}.{name}.weight", _blocks(kind, rows, cols, rng), raw_dtype=qtype)
        writer.add_tensor(f"blk.{i}.attn_output.weight", _blocks(kind, hidden, q, rng), raw_dtype=qtype)
        for norm, size in (
            ("attn_norm", hidden),
            ("ffn_norm", hidden),
            ("attn_q_norm", head_dim),
            ("attn_k_norm", head_dim),
        ):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(size, dtype=np.float32))
        router = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
        for name, rows, cols in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
            data = _blocks(kind, rows, cols, rng, experts)
            writer.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", data, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", _blocks(kind, vocab, hidden, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tokenizer_dir(gguf_path: Path, out: Path) -> Path:
    """The file's tokenizer as HF files (bench_serving's --tokenizer)."""
    from gguf import GGUFReader

    from radixserve.model_loader.gguf_convert import _special_token_ids, read_metadata, write_tokenizer

    meta = read_metadata(GGUFReader(str(gguf_path)))
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(meta, _special_token_ids(meta), 4096, str(out))
    return out


def _workloads(args: argparse.Namespace) -> list[Workload]:
    dataset = (
        *("--dataset-name", "random-ids", "--random-range-ratio", "1.0"),
        *("--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)),
    )
    return [
        Workload(
            "random",
            f"random {args.input_len}→{args.output_len}",
            c,
            max(args.min_prompts, 4 * c),
            args.input_len + args.output_len,
            dataset,
            args.seed + c,
        )
        for c in args.concurrency
    ]


def _serve(
    label: str, cmd: list[str], port: int, args: argparse.Namespace, tok: Path, kind: str
) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}"
    log = args.out_dir / f"{label}-{kind}.log"
    rows = []
    with ServerProcess(label, cmd, log, url) as server:
        server.wait_healthy(args.server_timeout)
        for w in _workloads(args):
            backend = "radixserve" if label == "radixserve" else "openai"
            rows.append(
                {**run_serving(label, backend, url, w, tok), "gguf_type": kind, "layers": args.layers}
            )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"], choices=sorted(_Q_STD))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="llama-server -t (radixserve uses its default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-timeout", type=float, default=1800.0)
    p.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_moe_gguf")
    p.add_argument("--results-file", type=Path, default=None)
    p.add_argument("--engines", nargs="+", default=["radixserve", "llama-server"])
    p.add_argument(
        "--radixserve-flags",
        default="",
        help="extra launch_server flags, e.g. '--cpu-wq-int8-activations' (recorded in each row)",
    )
    p.add_argument("--write-only", action="store_true")
    p.add_argument("--smoke", action="store_true", help="the tiny shape, 2 layers, C=1, 2 prompts")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.concurrency, args.min_prompts = 2, [1], 2
        args.input_len, args.output_len = 16, 8
    return args


def bytes_per_token(path: Path, shape: tuple[int, ...]) -> int:
    """The file's bytes one decode token must read: every tensor but the experts and the embedding
    in full, one embedding row, and top_k of the experts of each layer."""
    from gguf import GGUFReader

    num_experts, top_k = shape[4], shape[5]
    total = 0
    for t in GGUFReader(path).tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            n //= int(t.shape[-1])  # GGUF lists the row length first: shape[-1] is the vocabulary
        elif "_exps" in t.name:
            n = n * top_k // num_experts
        total += n
    return total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shape_name = "smoke" if args.smoke else "qwen3-30b-a3b"
    results_file = args.results_file or args.out_dir / "results.jsonl"
    for kind in args.types:
        path = args.out_dir / f"{shape_name}-{args.layers}l-{kind.lower()}.gguf"
        if not path.exists():
            print(f"writing {path}", flush=True)
            write_moe_gguf(path, kind, args.layers, SHAPES[shape_name], args.seed)
        per_token = bytes_per_token(path, SHAPES[shape_name])
        print(f"{path.name}: {per_token / 1e6:.1f} MB read per token", flush=True)
        if args.write_only:
            continue
        tok = tokenizer_dir(path, args.out_dir / f"tokenizer-{shape_name}")
        for engine in args.engines:
            port = free_port()
            if engine == "radixserve":
                cmd = [
                    sys.executable,
                    "-m",
                    "radixserve.launch_server",
                    "--model-path",
                    str(path),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    *args.radixserve_flags.split(),
                ]
            else:
                binary = llama_cpp.build_server()
                slots = max(args.concurrency)
                ctx = slots * (args.input_len + args.output_len + 16)
                cmd = llama_cpp.server_command(binary, path, port, args.threads, ctx, slots)
            for row in _serve(engine, cmd, port, args, tok, kind):
                row["bytes_per_token"] = per_token
                if engine == "radixserve":
                    row["radixserve_flags"] = args.radixserve_flags
                with open(results_file, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                print(
                    f"{engine} {kind} C={row['concurrency']}: {row['output_throughput']:.1f} output tok/s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
