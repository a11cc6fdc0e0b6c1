"""Embedding throughput: radixserve's Engine.encode vs sentence-transformers' encode, same inputs,
one run (docs/benchmarks.md, "Embeddings").

A random-weight BERT of bge-small's shape (384 hidden, 12 layers, 12 heads, 1536 intermediate,
CLS pooling, normalised) is written to a temp folder with the tiny test tokenizer (or, with
--model builtin, the built-in SmolLM2-135M is served with --is-embedding, last-token pooling); every input is
cut to exactly --tokens tokens by the tokenizer, and radixserve gets those very token ids.
sentence-transformers runs in this process (torch's default threads); the Engine's scheduler
process does its math while this process waits. After one warm-up pass each, the two alternate
for --repeats rounds (the shared machine's speed drifts) and the median of each is reported.

    python benchmark/bench_embeddings.py                 # 64 x 256 tokens, 3 repeats
    python benchmark/bench_embeddings.py --inputs 128 --tokens 128
    python benchmark/bench_embeddings.py --model builtin --inputs 256 --tokens 16   # many short
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPE = {  # BAAI/bge-small-en-v1.5's shape
    "hidden_size": 384,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
}
WORDS = "the quick brown fox jumps over lazy dog capital of France is Paris one two three four five".split()


def make_model(path: Path, model: str) -> dict[str, Any]:
    """Write the --model checkpoint to `path`; the Engine arguments it is served with."""
    from radixserve.testing.tiny_embedding_models import (
        make_tiny_embedding_model,
        write_sentence_transformers_files,
    )

    if model == "bge-small":
        make_tiny_embedding_model("bert", path, overrides=SHAPE)
        return {}
    # The built-in SmolLM2-135M as a Qwen3-Embedding-style model: last-token pooling, normalised
    # (its files linked, plus sentence-transformers' so that `encode` pools the same way).
    from radixserve.model_loader.default_model import ensure_default_model

    src = Path(ensure_default_model(show_progress=False))
    path.mkdir(parents=True)
    for f in src.iterdir():
        (path / f.name).symlink_to(f)
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    write_sentence_transformers_files(path, "lasttoken", True, hidden)
    return {"is_embedding": True}


def make_inputs(path: Path, n: int, tokens: int) -> tuple[list[str], list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(tokens * 2)) for _ in range(n)]
    ids = [tok(t, truncation=True, max_length=tokens)["input_ids"] for t in texts]
    assert all(len(x) == tokens for x in ids), "every input must be exactly --tokens tokens"
    return texts, ids


def round_robin(runners: list[Any], repeats: int) -> tuple[list[float], list[Any]]:
    """One warm-up pass each, then `repeats` rounds running each once in turn: the machine is
    shared and its speed drifts, and interleaving exposes every runner to the same drift.
    Median seconds per runner, and each runner's last output."""
    outs = [run() for run in runners]
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(repeats):
        for i, run in enumerate(runners):
            start = time.perf_counter()
            outs[i] = run()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times], outs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        choices=["bge-small", "builtin"],
        default="bge-small",
        help="a random BERT of bge-small's shape (CLS), or the built-in SmolLM2-135M with "
        "--is-embedding (last token)",
    )
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument(
        "--engine-args",
        default="{}",
        help="extra Engine (server) arguments as JSON, e.g. '{\"chunked_prefill_size\": -1}'",
    )
    parser.add_argument(
        "--bf16-gemm", action="store_true", help="also time the Engine with --cpu-bf16-gemm (a separate row)"
    )
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    from radixserve import Engine

    load_start = f"{os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        model_args = make_model(path, args.model)
        texts, ids = make_inputs(path, args.inputs, args.tokens)
        total = args.inputs * args.tokens
        st = SentenceTransformer(str(path), device="cpu")
        st.max_seq_length = args.tokens
        variants = [("radixserve Engine.encode", {})]
        if args.bf16_gemm:
            variants.append(("radixserve, --cpu-bf16-gemm", {"cpu_bf16_gemm": True}))
        base = {
            "max_total_tokens": max(4 * total, 8192),
            "log_level": "warning",
            **model_args,
            **json.loads(args.engine_args),
        }
        engines = [Engine(model_path=str(path), **base, **extra) for _, extra in variants]
        try:
            runners = [lambda: st.encode(texts, batch_size=args.batch_size)]
            runners += [lambda e=e: [o["embedding"] for o in e.encode(input_ids=ids)] for e in engines]
            times, outs = round_robin(runners, args.repeats)
        finally:
            for engine in engines:
                engine.shutdown()
        ref = torch.tensor(outs[0])
        rows = [("sentence-transformers encode", times[0], 1.0)]
        for (name, _), t, out in zip(variants, times[1:], outs[1:]):
            cos = torch.nn.functional.cosine_similarity(torch.tensor(out), ref, dim=-1).min().item()
            rows.append((name, t, cos))
        st_s = times[0]
        shape = (
            "bge-small shape (BERT, CLS)"
            if args.model == "bge-small"
            else "built-in SmolLM2-135M (last token)"
        )
        print(
            f"{args.inputs} inputs x {args.tokens} tokens, {shape}, torch threads {torch.get_num_threads()}, "
            f"load average {load_start} at the start, {os.getloadavg()[0]:.1f} at the end"
        )
        print(f"{'':32s} {'seconds':>8s} {'inputs/s':>9s} {'tokens/s':>9s} {'vs ST':>6s} {'min cos':>9s}")
        for name, sec, cos in rows:
            print(
                f"{name:32s} {sec:8.3f} {args.inputs / sec:9.1f} {total / sec:9.0f} {st_s / sec:5.2f}x {cos:9.6f}"
            )


if __name__ == "__main__":
    main()
