"""Quality of the quantized modes against fp32: perplexity on a fixed text shipped in the repo and
teacher-forced greedy agreement with the fp32 model.

    python benchmark/eval_quality.py                                    # the built-in model, every mode
    python benchmark/eval_quality.py --variants fp32 gguf int8wo --max-tokens 512
    python benchmark/eval_quality.py --model-path /models/x.gguf --text my.txt
    python benchmark/eval_quality.py --variants fp32 --chunk 512 --extra-gguf q8_0=/path/to/model-q8_0.gguf

Each variant starts an Engine with its server arguments and reads back the log-probability of every
token of the text given the tokens before it (prompt logprobs), with the top-1 token at each
position. The text is prefilled in chunks of --chunk tokens (--chunked-prefill-size).

What is scored is the model decode serves, whatever the chunk: the decoder layers of every mode
compute the same numbers at every batch size (W8A8 runs its int8 kernel at all sizes; a
weight-only layer's fp32 weight is its form's exact dequantization), and prompt logprobs score the
LM head in blocks of at most WQ_MAX_TOKENS rows, which read the head's quantized form where it has
one (layers/logits_processor.py's head_logits): w8a8_int8's int8 head, gguf's file tensor. The
chunk changes only summation order and speed: at 16 (the default) the weight-only modes' decoder
layers run linear_wq, at 512 oneDNN's GEMM over their dequantized weights (much faster where
sgl-kernel's linear_wq is not built).

- perplexity: exp(-mean log p(token | the tokens before it)) over the text after its first token;
- greedy agreement: the share of positions where the variant's most likely next token is fp32's;
- mean / max |delta logprob|: how far the variant's log-probability of the text's token is from
  fp32's, over the same positions.

The `-a8` variants quantize activations to int8 per 32 inputs (linear_wq_a8) in every product of
up to 8 rows, and are scored in chunks of at most 8 tokens: each row's product depends on that
row only, so this is what one stream's decode computes. The other weight-only variants are pinned
to exact activations (--disable-cpu-wq-int8-activations) whatever this machine's tuning chose.

`gguf-bf16` runs the decoder's products as oneDNN bf16 GEMMs (what decode at concurrency 16 and
up and prefill run where the CPU's tuning chose bf16 batch GEMMs), scored in chunks of at least
64 tokens. Its LM head is scored in head_logits' small blocks, which read the exact Q8_0 form; the
head's bf16 product at large batches is bounded by test/unit/test_cpu_batch_numerics.py. `gguf`
is pinned to fp32 batch GEMMs (--disable-cpu-bf16-gemm).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from radixserve.entrypoints.engine import Engine

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"
# int8 activations (linear_wq_a8) in products of up to 8 rows: pinned, whatever this machine's
# tuning measured, and scored in prefill chunks of at most that many tokens (CHUNK_CAP) so that
# every product takes them, as every step of a single stream does.
A8 = {"cpu_wq_int8_activations": True, "cpu_kernel_crossovers": '{"wq_max_tokens": 8, "wq_a8_max_tokens": 8}'}
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"quantization": "unquant"},
    "gguf": {"quantization": "gguf", "disable_cpu_wq_int8_activations": True, "disable_cpu_bf16_gemm": True},
    "gguf-a8": {"quantization": "gguf", **A8},
    # bf16 batch GEMMs (cpu_batch_numerics.py): scored in chunks of at least CHUNK_MIN tokens, so
    # every decoder product runs oneDNN's bf16 GEMM, as every decode step at concurrency >= 16 does.
    "gguf-bf16": {"quantization": "gguf", "cpu_bf16_gemm": True, "disable_cpu_wq_int8_activations": True},
    "w8a8_int8": {"quantization": "w8a8_int8"},
    "int8wo": {"torchao_config": "int8wo", "disable_cpu_wq_int8_activations": True},
    "int8wo-a8": {"torchao_config": "int8wo", **A8},
    "int4wo-64": {"torchao_config": "int4wo-64"},
    "int4wo-128": {"torchao_config": "int4wo-128"},
}
# The variants above keep fp32 K/V (--kv-cache-dtype float32; `auto` stores bf16 for quantized
# models on CPU); the -kv-bf16 ones store bf16 K/V: gguf-a8-kv-bf16 is the built-in model's default.
FP32_KV = {"kv_cache_dtype": "float32"}
for _name in list(VARIANTS):
    VARIANTS[_name] = {**VARIANTS[_name], **FP32_KV}
VARIANTS["gguf-kv-bf16"] = {**VARIANTS["gguf"], "kv_cache_dtype": "bf16"}
VARIANTS["gguf-a8-kv-bf16"] = {**VARIANTS["gguf-a8"], "kv_cache_dtype": "bf16"}
CHUNK_CAP = {"gguf-a8": 8, "int8wo-a8": 8, "gguf-a8-kv-bf16": 8}
CHUNK_MIN = {"gguf-bf16": 64}
LABELS = {
    "fp32": "fp32 (`--quantization unquant`)",
    "gguf": "`--quantization gguf` (the default), exact activations",
    "gguf-a8": "`--quantization gguf`, int8 activations (`--cpu-wq-int8-activations`)",
    "gguf-bf16": "`--quantization gguf`, bf16 batch GEMMs (`--cpu-bf16-gemm`)",
    "w8a8_int8": "`--quantization w8a8_int8`",
    "int8wo": "`--torchao-config int8wo`",
    "int8wo-a8": "`--torchao-config int8wo`, int8 activations",
    "int4wo-64": "`--torchao-config int4wo-64`",
    "int4wo-128": "`--torchao-config int4wo-128`",
    "gguf-kv-bf16": "`--quantization gguf`, exact activations, bf16 K/V",
    "gguf-a8-kv-bf16": "the built-in model's default: gguf, int8 activations, bf16 K/V",
}


def score(
    model_path: str | None, text: str, server_args: dict[str, Any], chunk: int, max_tokens: int
) -> dict:
    """Per position after the first: the text token's logprob and the top-1 token id."""
    with Engine(
        model_path=model_path, chunked_prefill_size=chunk, max_total_tokens=8192, **server_args
    ) as engine:
        ids = engine.tokenizer_manager.tokenizer.encode(text)[:max_tokens]
        out = engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
        )
    meta = out["meta_info"]
    pairs = [
        (entry[0], top[0][1])
        for entry, top in zip(meta["input_token_logprobs"], meta["input_top_logprobs"])
        if entry[0] is not None and top
    ]
    return {
        "logprobs": [lp for lp, _ in pairs],
        "top1": [t for _, t in pairs],
        "tokens": len(ids),
        "ids": ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--chunk", type=int, default=16, help="prefill chunk (tokens per forward)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument(
        "--extra-gguf",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also score another GGUF of the same model (e.g. llama.cpp's Q8_0 conversion that "
        "compare_peers serves) against the fp32 reference; repeatable",
    )
    args = parser.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    variants = ["fp32"] + [v for v in args.variants if v != "fp32"]
    results: dict[str, dict] = {}
    for name in variants:
        start = time.perf_counter()
        chunk = max(min(args.chunk, CHUNK_CAP.get(name, args.chunk)), CHUNK_MIN.get(name, 0))
        results[name] = score(args.model_path, text, VARIANTS[name], chunk, args.max_tokens)
        print(
            f"{name}: {len(results[name]['logprobs'])} positions in {time.perf_counter() - start:.0f} s",
            flush=True,
        )
        # Each row as soon as it is scored (a long run keeps what it has if stopped).
        print(table_row(LABELS[name], results[name], results["fp32"]), flush=True)
    for spec in args.extra_gguf:
        label, _, path = spec.partition("=")
        got = score(path, text, {"quantization": "gguf"}, args.chunk, args.max_tokens)
        if got["ids"] != results["fp32"]["ids"]:
            raise SystemExit(f"{path} tokenizes the text differently: its scores do not line up")
        results[label] = got
        LABELS[label] = f"`{Path(path).name}` (`--quantization gguf`)"
        variants.append(label)
    ref = results["fp32"]
    print(f"\n{ref['tokens']} tokens of {Path(args.text).name}, chunks of {args.chunk}\n")
    print("| mode | perplexity | greedy agreement with fp32 | mean \\|Δ logprob\\| | max \\|Δ logprob\\| |")
    print("|---|---:|---:|---:|---:|")
    for name in variants:
        print(table_row(LABELS[name], results[name], ref))


def table_row(label: str, got: dict, ref: dict) -> str:
    ppl = math.exp(-sum(got["logprobs"]) / len(got["logprobs"]))
    agree = sum(a == b for a, b in zip(got["top1"], ref["top1"])) / len(ref["top1"])
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])]
    return f"| {label} | {ppl:.3f} | {agree:.3f} | {sum(diffs) / len(diffs):.4f} | {max(diffs):.3f} |"


if __name__ == "__main__":
    main()
